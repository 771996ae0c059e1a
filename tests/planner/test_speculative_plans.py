"""Speculative batches through the planner: verify rows laid out natively or expanded from one
declaration, draft-extend rows spread from the accepted tokens, draft-decode steps.

Every field is checked against a plain Python reference; expanded and native verify must
describe the same rows; each draft-decode step plan must equal the decode plan of that
step's batch bit for bit; the three upstream bugs the issue names are pinned down.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from backends.deepgemm import reference_paged_mqa_schedule
from benchmarks.verify import spec_verify
from planner import ForwardBatch, ForwardMode, Limits, Planner
from planner.batch import step_batches
from planner.debug import diff_plans, padding_violations
from planner.dumps import dump_plans, load_dump
from tests.support.batches import make_pool
from tests.support.dumps import assert_same_bits
from tests.support.spec_batches import draft_decode_batch, draft_extend_batch, verify_batch

MAX_BATCH, MAX_CTX, PAGE, SMS = 5, 320, 64, 7
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=3)
SLOTS = int(TABLE.max()) + 1
VERIFY, EXTEND, DECODE = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE
DRAFT_DECODE = ForwardMode.DRAFT_DECODE


def _planner(next_n: int, steps: int = 0, *, native=None, backends=("nsa",)) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        next_n=next_n,
        draft_steps=steps,
        num_sms=SMS,
        kv_slots=SLOTS,
    )
    options = {"nsa": {"topk": 16, **({} if native is None else {"native_next_n": native})}}
    return Planner(list(backends), limits, options=options)


# ---- verify: native where deep_gemm takes next_n, expanded elsewhere ----------------------------


@pytest.mark.parametrize("next_n", range(1, 9))
def test_verify_rows_are_native_for_1_and_2_and_expanded_beyond(next_n):
    rng = random.Random(next_n)
    planner = _planner(next_n)
    batch = verify_batch(
        rng, TABLE, bs=rng.randint(1, MAX_BATCH), max_context=MAX_CTX, next_n=next_n
    )
    plan = planner.plan(batch)["nsa"]
    native = next_n <= 2
    kernel_n = next_n if native else 1
    assert plan.next_n == next_n and plan.kernel_next_n == kernel_n
    lens = batch.seq_lens_cpu.tolist()
    assert plan.kv_lens.tolist() == [n - (next_n - 1 - i) for n in lens for i in range(next_n)]
    repeat = 1 if native else next_n
    assert torch.equal(plan.kernel_page_table, plan.page_table.repeat_interleave(repeat, 0))
    if native:  # the page table itself: nothing copied, nothing repeated
        assert plan.kernel_page_table.data_ptr() == plan.page_table.data_ptr()
    want = reference_paged_mqa_schedule(plan.kv_lens.view(-1, kernel_n), 64, SMS)
    assert torch.equal(plan.schedule, want)


def test_forced_expansion_of_next_n_2_describes_the_same_rows():
    """One declaration: native_next_n (1,) expands next_n 2; rows and lengths are unchanged,
    the block table is repeated and the schedule is over the rows with next_n 1."""
    rng = random.Random(5)
    batch = verify_batch(rng, TABLE, bs=4, max_context=MAX_CTX, next_n=2)
    native = _planner(2).plan(batch)["nsa"]
    expanded = _planner(2, native=(1,)).plan(batch)["nsa"]
    assert (native.kernel_next_n, expanded.kernel_next_n) == (2, 1)
    for name in ("kv_lens", "page_table", "token_slots", "topk_lens", "positions"):
        assert torch.equal(getattr(native, name), getattr(expanded, name)), name
    assert expanded.kernel_page_table.shape[0] == 8
    assert torch.equal(
        expanded.schedule, reference_paged_mqa_schedule(native.kv_lens.view(8, 1), 64, SMS)
    )


def test_the_paged_backend_sees_verify_rows_as_before():
    """A backend that declares no native next_n is never expanded by another's declaration."""
    batch = verify_batch(random.Random(2), TABLE, bs=3, max_context=MAX_CTX, next_n=4)
    plans = _planner(4, backends=("nsa", "paged")).plan(batch)
    assert torch.equal(plans["paged"].kv_lens, plans["nsa"].kv_lens)
    assert plans["paged"].next_n == 4


# ---- draft extend ---------------------------------------------------------------------------------


def _draft_extend_reference(batch: ForwardBatch, next_n: int) -> dict[str, list[int]]:
    lens, acc = batch.seq_lens_cpu.tolist(), batch.extend_lens_cpu.tolist()
    locs = batch.out_cache_loc.tolist()
    out = {k: [] for k in ("kv_lens", "out_cache_loc", "positions", "row_valid", "row_tokens")}
    first = 0
    for n, a in zip(lens, acc):
        for i in range(next_n):
            real = i < a
            out["kv_lens"].append(n - a + i + 1 if real else 1)
            out["out_cache_loc"].append(locs[first + i] if real else 0)
            out["positions"].append(n - a + i if real else 0)
            out["row_valid"].append(int(real))
            out["row_tokens"].append(first + min(i, a - 1))
        first += a
    out["logit_rows"] = [b * next_n + a - 1 for b, a in enumerate(acc)]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_draft_extend_rows_equal_the_reference(seed):
    rng = random.Random(seed)
    next_n = rng.randint(2, 8)
    batch = draft_extend_batch(
        rng, TABLE, bs=rng.randint(1, MAX_BATCH), max_context=MAX_CTX, next_n=next_n
    )
    plans = _planner(next_n, backends=("nsa", "paged")).plan(batch)
    assert set(plans) == {"nsa"}  # only NSA declares a draft-extend schema
    plan, want = plans["nsa"], _draft_extend_reference(batch, next_n)
    for name, values in want.items():
        assert getattr(plan, name).tolist() == values, name
    assert plan.kernel_next_n == 1  # padding rows: always expanded for the indexer
    assert torch.equal(
        plan.schedule, reference_paged_mqa_schedule(plan.kv_lens.view(-1, 1), 64, SMS)
    )
    assert torch.equal(plan.topk_lens, plan.kv_lens.clamp(max=16))


def test_draft_extend_lengths_come_from_the_accepted_counts_not_the_staircase():
    """sglang #13236: expanded lengths built from the verify staircase of next_n tokens."""
    batch = draft_extend_batch(
        random.Random(0),
        TABLE,
        bs=2,
        max_context=MAX_CTX,
        next_n=4,
        accepted=[1, 3],
        lens=[100, 50],
    )
    plan = _planner(4).plan(batch)["nsa"]
    assert plan.kv_lens.tolist() == [100, 1, 1, 1, 48, 49, 50, 1]
    assert plan.logit_rows.tolist() == [0, 6]


def test_draft_extend_replay_never_reads_the_verify_schedule():
    """A draft-extend replay refreshes its own schedule, not the verify one captured beside it,
    whichever ran last, and each equals its eager plan."""
    planner = _planner(4)
    for mode in (VERIFY, EXTEND):
        planner.capture(4, mode, req_to_token=TABLE)
    rng = random.Random(1)
    for step in range(6):
        if step % 2:
            batch = draft_extend_batch(rng, TABLE, bs=3, max_context=MAX_CTX, next_n=4)
        else:
            batch = verify_batch(rng, TABLE, bs=3, max_context=MAX_CTX, next_n=4)
        plans = planner.replay(batch, 4)
        planner.record(4, ForwardMode(batch.mode))
        assert not diff_plans(plans, planner.plan(batch, pad_to=4))
        pads = planner.program(batch.mode).pads
        assert not padding_violations(plans, pads, planner.real_rows(batch.mode, batch))


def test_padded_speculative_batches_have_next_n_rows_per_padded_request():
    """sglang #34455 / vllm #32175: a padded verify or draft extend of bs real requests at size
    S has S * next_n rows, S * next_n / kernel_next_n kernel requests, and its padding rows
    (padding requests', and rows past an accepted count) hold the pads."""
    planner = _planner(3)
    rng = random.Random(4)
    for mode, make in ((VERIFY, verify_batch), (EXTEND, draft_extend_batch)):
        planner.capture(5, mode, req_to_token=TABLE)
        batch = make(rng, TABLE, bs=2, max_context=MAX_CTX, next_n=3)
        plan = planner.replay(batch, 5)["nsa"]
        planner.record(5, mode)
        assert plan.kv_lens.shape[0] == plan.positions.shape[0] == 15
        assert plan.kernel_page_table.shape[0] == 15
        assert planner.real_rows(mode, batch)["rows"] == 6
        assert not padding_violations(
            planner.replay(batch, 5), planner.program(mode).pads, planner.real_rows(mode, batch)
        )


def test_padding_checks_bite_on_a_row_past_the_accepted_tokens():
    planner = _planner(4)
    batch = draft_extend_batch(
        random.Random(0), TABLE, bs=2, max_context=MAX_CTX, next_n=4, accepted=[1, 4]
    )
    plans = planner.plan(batch, pad_to=3)
    plans["nsa"].out_cache_loc[1] = 77  # a padding row inside request 0
    bad = padding_violations(plans, planner.program(EXTEND).pads, planner.real_rows(EXTEND, batch))
    assert bad == ["nsa.out_cache_loc"]


# ---- draft decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 7])
def test_each_draft_decode_step_is_the_decode_plan_of_its_batch(steps):
    rng = random.Random(steps)
    planner = _planner(steps + 1, steps, backends=("nsa", "paged"))
    batch = draft_decode_batch(
        rng, TABLE, bs=rng.randint(1, MAX_BATCH), max_context=MAX_CTX, steps=steps
    )
    plans = planner.plan(batch)
    assert len(plans.steps) == steps and set(plans) == {
        f"{b}@{s}" for b in ("nsa", "paged") for s in range(steps)
    }
    lens = batch.seq_lens_cpu.tolist()
    for s, one in enumerate(step_batches(batch)):
        assert one.seq_lens_cpu.tolist() == [n - (steps - 1 - s) for n in lens]  # +1 per step
        assert not diff_plans(plans.step(s), planner.plan(one))
        assert (
            plans.step(s)["nsa"].out_cache_loc.tolist()
            == batch.out_cache_loc.view(-1, steps)[:, s].tolist()
        )
    with pytest.raises(Exception, match="plans.step"):
        plans["nsa"]


def test_draft_decode_replays_every_step_from_one_staging_copy():
    planner = _planner(4, 3)
    captured = planner.capture(4, DRAFT_DECODE, req_to_token=TABLE)
    stager = planner.storages.static(DRAFT_DECODE, 3)[0].stager
    rng = random.Random(8)
    for _ in range(4):
        batch = draft_decode_batch(rng, TABLE, bs=rng.randint(1, 4), max_context=MAX_CTX, steps=3)
        before = stager.transport.copies
        plans = planner.replay(batch, 4)
        planner.record(4, DRAFT_DECODE)
        assert plans is captured and stager.transport.copies == before + 1
        assert not diff_plans(plans, planner.plan(batch, pad_to=4))
        pads = planner.program(DRAFT_DECODE).pads
        assert not padding_violations(plans, pads, planner.real_rows(DRAFT_DECODE, batch))
        steps = [plans.step(s)["nsa"] for s in range(3)]
        ptrs = {p.schedule.data_ptr() for p in steps}
        assert len(ptrs) == 3  # each step's layers read their own schedule
    calls = planner.stats.op_calls_per_batch(DRAFT_DECODE)
    assert calls["paged_mqa_schedule"] == 3  # one per step per batch, whatever the layers


def test_draft_decode_needs_draft_steps():
    planner = _planner(2)
    batch = draft_decode_batch(random.Random(0), TABLE, bs=1, max_context=MAX_CTX, steps=2)
    with pytest.raises(Exception, match="draft_steps"):
        planner.plan(batch)


def test_gpu_verify_script_smoke_mode(tmp_path):
    """``python -m benchmarks spec_verify --smoke``: the H200 script's checks on the CPU (emulated
    graphs, references for the kernels), expanded and native verify, all passing."""
    assert spec_verify.main(["--smoke", "--cases", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "verify_spec_verify.json").read_text())
    assert report["ok"] and len(report["parts"]) == 3
    assert report["parts"]["next_n=4 (expanded)"]["layouts"] == ["expanded"]
    assert report["parts"]["next_n=2 native"]["layouts"] == ["native"]
    assert all(part["graph_replays"] == part["cases"] for part in report["parts"].values())


def test_a_draft_decode_plan_set_dumps_and_loads_every_step(tmp_path):
    planner = _planner(4, 3, backends=("nsa", "paged"))
    batch = draft_decode_batch(random.Random(2), TABLE, bs=3, max_context=MAX_CTX, steps=3)
    plans = planner.plan(batch)
    loaded = load_dump(dump_plans(plans, tmp_path / "d", step=1, batch=batch))
    assert loaded.backends == list(plans)  # nsa@0, paged@0, nsa@1, ...
    assert_same_bits(plans, loaded)
