"""The replay lane changes no behaviour: a planner with lanes and one without them accept,
refuse (same error, same field) and stage (same bytes) exactly alike, on random and hostile
batches; the lane takes every valid host decode and verify batch, and its plans equal a
fresh eager plan's. Setups with host ops (FlashInfer's plan, through its torch provider on
the CPU) run them in the lane too."""

from __future__ import annotations

import dataclasses
import functools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import ForwardMode, PlanError
from planner.materialise import run_steps
from planner.replay_lane import ReplayLane
from tests.support.planners import PlannerSetup

DECODE = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64)
VERIFY = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"next_n": 2}
)
FLASHINFER = PlannerSetup(
    ("flashinfer_decode", "flashinfer_mla"),
    max_batch=4,
    max_context=256,
    page_size=64,
    options={
        "flashinfer_decode": {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        "flashinfer_mla": {"num_heads": 2},
    },
)
NSA_FLASHINFER = PlannerSetup(
    ("nsa", "nsa_flashinfer"),
    max_batch=4,
    max_context=256,
    page_size=64,
    options={
        "nsa": {"topk": 16, "mla_heads": 2, "mla_kernel": "torch"},
        "nsa_flashinfer": {"sparse_topk": 16, "sparse_heads": 2, "sparse_sm_scale": 0.25},
    },
)
CASES = {
    "nsa+paged decode": (DECODE, ForwardMode.DECODE),
    "nsa+paged verify": (VERIFY, ForwardMode.TARGET_VERIFY),
    "flashinfer decode (host ops)": (FLASHINFER, ForwardMode.DECODE),
    "nsa_flashinfer decode (host op)": (NSA_FLASHINFER, ForwardMode.DECODE),
}
BS = 4


class _Sub(torch.Tensor):
    """A tensor subclass: the door takes it, the lane leaves it to the general path."""


class _Duck:
    """Not a tensor, but answers every question the lane asks of one as the tensor does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def __getattr__(self, name):
        return getattr(self._t, name)


@functools.cache
def _pair(case: str):
    """A planner with lanes and one without, both captured at ``BS``; the mode."""
    setup, mode = CASES[case]
    fast, plain = setup.planner(), setup.planner()
    for planner in (fast, plain):
        planner.capture(BS, mode, req_to_token=setup.table)
    assert (mode, BS) in fast._lanes
    plain._lanes.clear()
    return setup, fast, plain, mode


def _outcome(planner, batch, bs):
    """What a replay did: the error's class and field, or the staged device buffer."""
    try:
        plans = planner.replay(batch, bs)
    except PlanError as err:
        return (type(err).__name__, err.field), None
    stager = planner._captured[(plans.mode, plans.reqs)].storages[0].stager
    return stager.device_buf.clone(), plans


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], dim=1)[:, 0]


HOSTILE = {
    "valid": lambda b, t: b,
    "int64 lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu.long()),
    "2-D lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu[None]),
    "strided lengths": lambda b, t: dataclasses.replace(
        b, seq_lens_cpu=_noncontiguous(b.seq_lens_cpu)
    ),
    "subclass lengths": lambda b, t: dataclasses.replace(
        b, seq_lens_cpu=b.seq_lens_cpu.as_subclass(_Sub)
    ),
    "duck lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=_Duck(b.seq_lens_cpu)),
    "duck slots": lambda b, t: dataclasses.replace(b, out_cache_loc=_Duck(b.out_cache_loc)),
    "meta lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu.to("meta")),
    "int16 pool": lambda b, t: dataclasses.replace(
        b, req_pool_indices=b.req_pool_indices.to(torch.int16)
    ),
    "int32 pool": lambda b, t: dataclasses.replace(b, req_pool_indices=b.req_pool_indices.int()),
    "short pool": lambda b, t: dataclasses.replace(b, req_pool_indices=b.req_pool_indices[:-1]),
    "strided pool": lambda b, t: dataclasses.replace(
        b, req_pool_indices=_noncontiguous(b.req_pool_indices)
    ),
    "subclass slots": lambda b, t: dataclasses.replace(
        b, out_cache_loc=b.out_cache_loc.as_subclass(_Sub)
    ),
    "int32 slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.int()),
    "float slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.float()),
    "long slots": lambda b, t: dataclasses.replace(
        b, out_cache_loc=torch.cat([b.out_cache_loc, b.out_cache_loc[:1]])
    ),
    "repeated slot": lambda b, t: dataclasses.replace(
        b, out_cache_loc=b.out_cache_loc[:1].repeat(b.out_cache_loc.shape[0])
    ),
    "slot out of range": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc + 10**9),
    "meta slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.to("meta")),
    "no positions": lambda b, t: dataclasses.replace(b, positions=None),
    "int64 positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions.long()
    ),
    "wrong positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions + 1
    ),
    "short positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions[:-1]
    ),
    "another table": lambda b, t: dataclasses.replace(b, req_to_token=t.clone()),
    "the table as float": lambda b, t: dataclasses.replace(b, req_to_token=t.view(torch.float32)),
    "the table transposed in place": lambda b, t: dataclasses.replace(
        b, req_to_token=t.as_strided(t.shape, (1, t.shape[0]))
    ),
    "a narrower table": lambda b, t: dataclasses.replace(b, req_to_token=t[:, :-64]),
    "next_n off": lambda b, t: dataclasses.replace(b, next_n=b.next_n + 1),
    "extend lengths given": lambda b, t: dataclasses.replace(
        b, extend_lens_cpu=torch.full_like(b.seq_lens_cpu, b.next_n)
    ),
    "device lengths given": lambda b, t: dataclasses.replace(b, seq_lens=b.seq_lens_cpu.clone()),
    "int64 device lengths": lambda b, t: dataclasses.replace(b, seq_lens=b.seq_lens_cpu.long()),
    "device extend lengths alone": lambda b, t: dataclasses.replace(
        b, extend_lens=torch.full_like(b.seq_lens_cpu, b.next_n)
    ),
    "mode as a string": lambda b, t: dataclasses.replace(b, mode=b.mode.value),
    "unhashable mode": lambda b, t: dataclasses.replace(b, mode=[b.mode]),
    "mode idle": lambda b, t: dataclasses.replace(b, mode=ForwardMode.IDLE),
    "no requests": lambda b, t: dataclasses.replace(
        b,
        seq_lens_cpu=b.seq_lens_cpu[:0],
        req_pool_indices=b.req_pool_indices[:0],
        out_cache_loc=b.out_cache_loc[:0],
        positions=None,
    ),
    "not a ForwardBatch": lambda b, t: SimpleNamespace(**{f: getattr(b, f) for f in b.__slots__}),
}


def _same(case, batch, size) -> None:
    """Both planners do the same with ``batch`` at ``size``; the lane's plans are eager's."""
    _, fast, plain, _ = _pair(case)
    want, _ = _outcome(plain, batch, size)
    got, plans = _outcome(fast, batch, size)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, want)
        fast.record(plans.reqs, plans.mode)  # what the graph's replay runs
        fast.verify(batch, plans)  # bit-equal to a fresh eager plan of the batch
    else:
        assert got == want


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("case", CASES)
def test_a_planner_with_lanes_behaves_as_one_without(case, hostile):
    """Every hostile change, at every batch size, with positions given and left out."""
    setup, fast, _, mode = _pair(case)
    n = fast.tokens_per_request(mode)
    for bs in range(1, BS + 1):
        for seed, positions in enumerate((True, False)):
            rng = random.Random(1000 * bs + seed)
            batch = setup.batch(rng, bs=bs, next_n=n, mode=mode, positions=positions)
            _same(case, HOSTILE[hostile](batch, setup.table), BS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(sorted(CASES)),
    seed=st.integers(0, 10**6),
    bs=st.integers(1, BS),
    positions=st.booleans(),
    size=st.sampled_from([BS, True, float(BS), np.int64(BS), BS - 1, 0, -1]),
)
def test_the_size_argument_is_checked_alike(case, seed, bs, positions, size):
    """A bool, a float, a numpy int, a size too small for the batch, out of range."""
    setup, fast, _, mode = _pair(case)
    n = fast.tokens_per_request(mode)
    batch = setup.batch(random.Random(seed), bs=bs, next_n=n, mode=mode, positions=positions)
    _same(case, batch, size)


@pytest.mark.parametrize("case", CASES)
def test_the_lane_takes_every_valid_host_batch_and_sends_nothing_when_it_declines(case):
    setup, fast, _, mode = _pair(case)
    lane = fast._lanes[(mode, BS)]
    stager = lane.stager
    n = fast.tokens_per_request(mode)
    for seed in range(30):
        rng = random.Random(seed)
        bs = rng.randint(2, BS)  # two requests at least: a repeated slot is a repeat
        batch = setup.batch(rng, bs=bs, next_n=n, mode=mode, positions=rng.random() < 0.5)
        before = stager.copies
        assert lane.run(batch), "a valid host batch must take the lane"
        assert stager.copies == before + 1
        for name in ("subclass slots", "repeated slot", "wrong positions", "another table"):
            before = stager.copies
            bad = HOSTILE[name](batch, setup.table)
            if bad.positions is None and name == "wrong positions":
                continue
            assert not lane.run(bad), name
            assert stager.copies == before, f"{name}: declined, yet something was sent"


def test_lanes_are_made_for_screened_uniform_captures_only():
    setup = DECODE
    planner = setup.planner()
    planner.capture(BS, ForwardMode.DECODE, req_to_token=setup.table)
    assert isinstance(planner._lanes[(ForwardMode.DECODE, BS)], ReplayLane)
    drafts = setup.planner(draft_steps=2)
    drafts.capture(BS, ForwardMode.DRAFT_DECODE, req_to_token=setup.table)
    assert (ForwardMode.DRAFT_DECODE, BS) not in drafts._lanes  # stepped: several regions


def test_debug_mode_replays_through_the_general_path(monkeypatch):
    """Debug replays read device-resident inputs and the table: never the lane."""
    setup, fast, _, _ = _pair("nsa+paged decode")
    lane = fast._lanes[(ForwardMode.DECODE, BS)]
    calls = []
    monkeypatch.setattr(type(lane), "run", lambda self, b: calls.append(b) or False)
    monkeypatch.setattr(fast, "debug", True)
    batch = setup.batch(random.Random(3), bs=2, positions=True)
    plans = fast.replay(batch, BS)
    fast.record(BS)
    fast.verify(batch, plans)
    assert calls == []


@pytest.mark.parametrize("case", [c for c in CASES if "host op" in c])
def test_prepared_host_calls_do_what_run_steps_does(case):
    """A capture's host steps as prepared calls (``HostCall``) against ``run_steps`` over the
    same tensors: the same handles, the same outputs, batch after batch."""
    setup, fast, _, mode = _pair(case)
    captured = fast._captured[(mode, BS)]
    assert len(captured.host_calls) == len(captured.host_steps) > 0
    step = captured.steps[0]
    for seed in range(10):
        batch = setup.batch(random.Random(seed), positions=seed % 2 == 0)
        (prepared,) = captured.run_host_ops(batch)
        outs = [step.tensors[call.output].clone() for call in captured.host_calls]
        general = run_steps(captured.host_steps, step.tensors, batch, True)
        assert prepared.keys() == general.keys()
        assert all(prepared[k] is general[k] for k in general)
        for call, out in zip(captured.host_calls, outs):
            assert torch.equal(step.tensors[call.output], out)


def test_a_prepared_host_call_falls_back_as_a_step_does(monkeypatch):
    """A host op's provider that fails at replay is retired, once, and the next one runs:
    the prepared call goes through the same provider chain."""
    setup, _, _, mode = _pair("nsa_flashinfer decode (host op)")
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    (call,) = planner._captured[(mode, BS)].host_calls
    chain = call.chain
    failing = dataclasses.replace(chain.current, name="flaky", fn=_raise)
    monkeypatch.setattr(chain, "current", failing)
    monkeypatch.setattr(chain.op, "providers", {**chain.op.providers, "flaky": failing})
    with pytest.warns(RuntimeWarning, match="flaky"):
        call.run(setup.batch(random.Random(0)))
    assert chain.current.name != "flaky" and "flaky" in chain.retired


def _raise(*args, **kwargs):
    raise RuntimeError("a provider that fails on its first call")


@pytest.mark.parametrize("case", [c for c in CASES if "host op" in c])
def test_host_op_summaries_ride_the_staging_copy(case):
    """A host op's small output lives in the staging buffer's appendix: the lane writes it
    into the pinned buffer before the one copy, and the plan's tensor (a view of the
    staged device buffer) then holds what a fresh eager plan holds."""
    setup, fast, _, mode = _pair(case)
    lane = fast._lanes[(mode, BS)]
    assert lane.staged, "the FlashInfer summaries should be staged"
    stager = lane.stager
    base, end = stager.device_buf.data_ptr(), stager.device_buf.data_ptr() + 4 * stager._size
    for call, _ in lane.staged:
        assert base <= call.out.data_ptr() < end  # inside the staged device buffer
    for seed in range(8):
        batch = setup.batch(random.Random(seed), positions=seed % 2 == 0)
        assert lane.run(batch)
        fast.record(BS, mode)
        fast.verify(batch, lane.plans)


def test_a_staged_host_call_that_fails_leaves_the_replay_to_the_general_path(monkeypatch):
    """Nothing is sent when a staged host call raises: the general replay runs it again
    through its chain (which falls back), and the plans are still eager's."""
    setup, _, _, mode = _pair("flashinfer decode (host ops)")
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    lane = planner._lanes[(mode, BS)]
    call, _ = lane.staged[0]
    calls = []

    def failing(args, host_out=None):
        calls.append(host_out)
        raise RuntimeError("a replay call that fails")

    object.__setattr__(call, "fast", failing)
    stager, batch = lane.stager, setup.batch(random.Random(5), positions=True)
    before = stager.copies
    assert not lane.run(batch) and stager.copies == before and calls
    plans = planner.replay(batch, BS)  # the general path: the chain's provider, not `fast`
    planner.record(BS, mode)
    planner.verify(batch, plans)
