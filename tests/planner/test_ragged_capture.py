"""Extend and mixed batches captured and replayed like decode: per (bs, tokens) bucket.

A replay of a bucket equals ``plan(batch, pad_to=bs, pad_tokens=tokens)`` bit for bit, through
an emulated graph that re-runs ``record`` (the graph-safe ops) at every replay; its real rows
equal the unpadded eager plan's; its padding holds the declared pads; debug mode verifies it
and catches a stale field; a batch a bucket cannot hold is refused by ``replay`` naming the
field, before any buffer is touched; bad values and a KV past the bucket's bound are refused
by the device check in the graph: the plans get pads only and ``Planner.read`` raises naming
the field. Both with a schema of this module's own (the shared ragged ops) and with the real
``nsa`` extend plan.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs import EmulatedGraph
from planner import (
    BatchError,
    ConfigError,
    ForwardBatch,
    ForwardMode,
    Limits,
    Planner,
    PlanSet,
    ReplayError,
    SchemaError,
)
from planner.batch import RAGGED_MODES
from planner.debug import diff_plans, padding_violations
from planner.schema import PAD_DERIVED, Plan, Setting, Tensor, tensor_field
from tests.support.batches import make_pool
from tests.support.catalogue import not_pads

EXTEND, MIXED, DECODE = ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE
MAX_BATCH, MAX_CTX, PAGE, MAX_TOKENS = 6, 128, 64, 96
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=3)
SLOTS = int(TABLE.max()) + 1
BUCKETS = ((2, 8), (4, 24), (6, 4), (6, 48), (6, MAX_TOKENS))
"""(bs, tokens) captured in every mode: a token bucket below bs among them."""
I32 = torch.int32


class RaggedTestPlan(Plan, backend="test-ragged", modes=RAGGED_MODES):
    """Every shared ragged op over padded inputs: per-request, per-token, (2, tokens), flat KV."""

    seq_lens: Tensor = tensor_field(I32, ("reqs",), source="seq_lens", pad=1)
    extend_lens: Tensor = tensor_field(I32, ("reqs",), source="extend_lens", pad=0)
    req_pool_indices: Tensor = tensor_field(I32, ("reqs",), source="req_pool_indices", pad=0)
    out_cache_loc: Tensor = tensor_field(I32, ("tokens",), source="out_cache_loc", pad=0)
    positions: Tensor = tensor_field(I32, ("tokens",), source="positions", pad=0)
    qo_indptr: Tensor = tensor_field(
        I32, ("reqs+1",), op="cumsum_with_zero", inputs=("extend_lens",), pad=PAD_DERIVED
    )
    kv_indptr: Tensor = tensor_field(
        I32, ("reqs+1",), op="cumsum_with_zero", inputs=("seq_lens",), pad=PAD_DERIVED
    )
    kv_slots: Tensor = tensor_field(
        I32,
        ("kv_tokens",),
        op="kv_gather_slots",
        inputs=("req_to_token", "req_pool_indices", "kv_indptr"),
        pad=0,
    )
    token_request: Tensor = tensor_field(
        I32, ("tokens",), op="token_request", inputs=("qo_indptr",), params={"pad": 0}, pad=0
    )
    kv_lens: Tensor = tensor_field(
        I32, ("tokens",), op="token_causal_lengths", inputs=("qo_indptr", "seq_lens"), pad=1
    )
    kv_ranges: Tensor = tensor_field(
        I32, (2, "tokens"), op="token_kv_ranges", inputs=("qo_indptr", "kv_indptr"), pad=PAD_DERIVED
    )
    logit_rows: Tensor = tensor_field(
        I32, ("reqs",), op="last_token_rows", inputs=("qo_indptr",), pad=PAD_DERIVED
    )
    cache_pages: Tensor = tensor_field(
        I32,
        (2, "tokens"),
        op="slot_pages",
        inputs=("out_cache_loc",),
        params={"page_size": Setting("page_size")},
        pad=PAD_DERIVED,
    )


def make_planner(backend: str, **kw) -> Planner:
    limits = {"max_batch": MAX_BATCH, "max_context": MAX_CTX, "page_size": PAGE}
    limits |= {"num_sms": 8, "kv_slots": SLOTS, "max_tokens": MAX_TOKENS}
    limits |= {k: kw.pop(k) for k in list(kw) if k in Limits.model_fields}
    options = {"nsa": {"topk": 16}} if backend == "nsa" else None
    return Planner([backend], Limits(**limits), options=options, **kw)


class Captured:
    """A planner with every bucket of both ragged modes captured, each under its own graph."""

    def __init__(self, backend: str, **kw) -> None:
        self.planner = make_planner(backend, **kw)
        self.graphs: dict[tuple[ForwardMode, int, int], EmulatedGraph] = {}
        for mode in (EXTEND, MIXED):
            for bs, tokens in BUCKETS:
                self.planner.capture(bs, mode, req_to_token=TABLE, tokens=tokens)
                graph = EmulatedGraph()
                graph.capture(self._body(mode, bs, tokens))
                self.graphs[(mode, bs, tokens)] = graph

    def _body(self, mode: ForwardMode, bs: int, tokens: int):
        """What the graph holds: the planner's in-graph ops (a model's layers would follow)."""

        def body() -> list[torch.Tensor]:
            self.planner.record(bs, mode, tokens=tokens)
            return []

        return body

    def replay(self, batch: ForwardBatch, bs: int, tokens: int) -> PlanSet:
        plans = self.planner.replay(batch, bs, tokens=tokens)
        self.graphs[(batch.mode, bs, tokens)].replay()
        return plans


_CAPTURED: dict[str, Captured] = {}


def captured(backend: str) -> Captured:
    """Built once per backend (capture is the slow part); debug mode on."""
    if backend not in _CAPTURED:
        _CAPTURED[backend] = Captured(backend, debug=True)
    return _CAPTURED[backend]


@st.composite
def ragged_batches(draw, mode: ForwardMode | None = None, max_tokens: int = MAX_TOKENS):
    mode = mode or draw(st.sampled_from([EXTEND, MIXED]))
    bs = draw(st.integers(1, MAX_BATCH))
    pools = draw(st.permutations(range(1, TABLE.shape[0])))[:bs]
    lens = draw(st.lists(st.integers(1, MAX_CTX), min_size=bs, max_size=bs))
    new = [draw(st.integers(1, min(n, max(1, max_tokens // bs)))) for n in lens]
    if mode is MIXED:
        new[0] = 1  # a decode request among the extends
    locs = [int(TABLE[p, q]) for p, n, e in zip(pools, lens, new) for q in range(n - e, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=I32),
        req_pool_indices=torch.tensor(pools, dtype=I32),
        req_to_token=TABLE,
        out_cache_loc=torch.tensor(locs, dtype=I32),
        mode=mode,
        extend_lens_cpu=torch.tensor(new, dtype=I32),
    )


def smallest_bucket(batch: ForwardBatch) -> tuple[int, int]:
    return min(
        ((bs, t) for bs, t in BUCKETS if bs >= batch.bs and t >= batch.num_tokens),
        key=lambda b: (b[1], b[0]),
    )


def real_part(shape, tensor: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
    """The real rows of a field (None: a shape not over the batch, e.g. a split table)."""
    real = {"reqs": batch.bs, "tokens": batch.num_tokens, "kv_tokens": batch.seq_lens_cpu.sum()}
    index = []
    for expr in shape:
        if isinstance(expr, int):
            index.append(slice(None))
            continue
        name, _, offset = expr.partition("+")
        if name not in real:
            return None
        index.append(slice(0, int(real[name]) + int(offset or 0)))
    return tensor[tuple(index)]


def check_bucket_replay(backend: str, batch: ForwardBatch, bs: int, tokens: int) -> None:
    setup = captured(backend)
    planner = setup.planner
    plans = setup.replay(batch, bs, tokens)
    assert plans.tokens == tokens and plans.reqs == bs and plans.real_reqs == batch.bs
    padded = planner.plan(batch, pad_to=bs, pad_tokens=tokens)
    assert diff_plans(plans, padded) == []
    program = planner.program(batch.mode)
    assert padding_violations(plans, program.pads, planner.real_rows(batch.mode, batch)) == []
    before = planner.stats.verified
    planner.verify(batch, plans)  # debug mode's check of the production path
    assert planner.stats.verified == before + 1
    eager = planner.plan(batch)
    for name, spec in type(eager[backend]).tensor_specs.items():
        want = real_part(spec.shape, getattr(eager[backend], name), batch)
        got = real_part(spec.shape, getattr(plans[backend], name), batch)
        if want is not None:
            assert torch.equal(got, want), name
    # padding never writes real KV, nor reads it through the gathered slots
    plan = plans[backend]
    assert (plan.out_cache_loc[batch.num_tokens :] == 0).all()
    assert (plan.kv_slots[int(batch.seq_lens_cpu.sum()) :] == 0).all()
    qo = plan.qo_indptr
    assert (qo[1:] >= qo[:-1]).all() and int(qo[-1]) == batch.num_tokens
    assert (plan.logit_rows >= 0).all() and (plan.logit_rows < tokens).all()
    assert (plan.token_request >= 0).all() and (plan.token_request < bs).all()
    ranges = plan.kv_ranges
    assert (ranges[0] >= 0).all() and (ranges[1] <= plan.kv_slots.shape[0]).all()
    assert (ranges[0] < ranges[1]).all()


@pytest.mark.parametrize("backend", ["test-ragged", "nsa"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=ragged_batches())
def test_ragged_replay_equals_the_padded_eager_plan(backend, batch):
    check_bucket_replay(backend, batch, *smallest_bucket(batch))


@pytest.mark.parametrize("backend", ["test-ragged", "nsa"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=ragged_batches(max_tokens=4), data=st.data())
def test_every_bucket_holding_a_batch_replays_it(backend, batch, data):
    """Buckets share buffers: replaying one never leaves another's plans wrong."""
    fits = [(bs, t) for bs, t in BUCKETS if bs >= batch.bs and t >= batch.num_tokens]
    for bs, tokens in data.draw(st.permutations(fits)):
        check_bucket_replay(backend, batch, bs, tokens)


def test_debug_mode_catches_a_stale_ragged_field():
    """A replay whose graph did not run is refused by ``verify``, naming a field the graph
    writes: the source fields too (the device check writes them inside the graph), so the
    first named is ``seq_lens``, and the ops' fields are stale with them."""
    setup = Captured("test-ragged", debug=True)
    planner, rng = setup.planner, random.Random(7)
    first = _batch(rng, [40, 9], [5, 3])
    setup.replay(first, 4, 24)
    planner.verify(first, planner.replay(first, 4, tokens=24))  # graph ran for first: fine
    second = _batch(rng, [70, 20, 33], [2, 7, 4])
    plans = planner.replay(second, 4, tokens=24)  # no graph replay: device fields stale
    with pytest.raises(ReplayError, match="differs from eager") as err:
        planner.verify(second, plans)
    assert err.value.field == "test-ragged.seq_lens"
    assert "test-ragged.kv_slots" in str(err.value)  # an op's field, stale as well
    assert plans["test-ragged"].seq_lens.tolist() == [40, 9, 1, 1]  # the first batch's


def _batch(rng: random.Random, lens: list[int], new: list[int], mode=EXTEND) -> ForwardBatch:
    pools = rng.sample(range(1, TABLE.shape[0]), len(lens))
    locs = [int(TABLE[p, q]) for p, n, e in zip(pools, lens, new) for q in range(n - e, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=I32),
        req_pool_indices=torch.tensor(pools, dtype=I32),
        req_to_token=TABLE,
        out_cache_loc=torch.tensor(locs, dtype=I32),
        mode=mode,
        extend_lens_cpu=torch.tensor(new, dtype=I32),
    )


def test_buckets_are_listed():
    planner = captured("test-ragged").planner
    assert planner.captured_buckets(EXTEND) == sorted(BUCKETS)
    assert planner.captured_batch_sizes(MIXED) == [2, 4, 6]
    nsa = make_planner("nsa")
    nsa.capture(3, DECODE, req_to_token=TABLE)
    assert nsa.captured_batch_sizes(DECODE) == [3] and nsa.captured_buckets(DECODE) == [(3, 3)]
    assert nsa.captured_buckets(EXTEND) == []


def _rng_batch(seed: int = 1) -> ForwardBatch:
    return _batch(random.Random(seed), [40, 9, 100], [5, 3, 10])


CAPTURE_REFUSALS = {
    "ragged without tokens": (dict(bs=2, mode=EXTEND), "tokens"),
    "decode with tokens": (dict(bs=2, mode=DECODE, tokens=4), "tokens"),
    "tokens zero": (dict(bs=2, mode=MIXED, tokens=0), "tokens"),
    "tokens past max_tokens": (dict(bs=2, mode=EXTEND, tokens=MAX_TOKENS + 1), "tokens"),
    "tokens not an int": (dict(bs=2, mode=EXTEND, tokens=8.0), "tokens"),
    "bs past max_batch": (dict(bs=MAX_BATCH + 1, mode=EXTEND, tokens=8), "bs"),
    "idle": (dict(bs=2, mode=ForwardMode.IDLE), "mode"),
}


@pytest.mark.parametrize("case", CAPTURE_REFUSALS)
def test_capture_refusals_name_the_field(case):
    kwargs, field = CAPTURE_REFUSALS[case]
    planner = make_planner("nsa")
    with pytest.raises(BatchError) as err:
        planner.capture(req_to_token=TABLE, **kwargs)
    assert err.value.field == field
    assert planner.captured_buckets(kwargs["mode"]) == []


def test_replay_refusals_name_the_field_and_touch_nothing():
    setup = captured("test-ragged")
    planner, batch = setup.planner, _rng_batch()  # 3 requests, 18 tokens, 149 KV tokens
    plans = setup.replay(batch, 4, 24)
    snapshot = {k: t.clone() for k, t in plans["test-ragged"].tensors().items()}
    staged = planner._captured[(EXTEND, (4, 24))].stager.device_buf.clone()
    cases = [
        (dict(bs=4), BatchError, "tokens"),  # a ragged replay names its bucket
        (dict(bs=2, tokens=24), BatchError, "bs"),  # more requests than bs
        (dict(bs=6, tokens=4), BatchError, "tokens"),  # more tokens than the bucket
        (dict(bs=4, tokens=0), BatchError, "tokens"),
        (dict(bs=4, tokens=48), ReplayError, "tokens"),  # a bucket not captured at this bs
        (dict(bs=5, tokens=24), ReplayError, "bs"),  # no capture of that size at all
    ]
    for kwargs, error, field in cases:
        with pytest.raises(error) as err:
            planner.replay(batch, **kwargs)
        assert err.value.field == field, kwargs
    with pytest.raises(ReplayError) as err:
        planner.record(4, EXTEND, tokens=48)
    assert err.value.field == "tokens"
    for name, tensor in plans["test-ragged"].tensors().items():
        assert torch.equal(tensor, snapshot[name]), name
    assert torch.equal(planner._captured[(EXTEND, (4, 24))].stager.device_buf, staged)


def _with(batch: ForwardBatch, **fields) -> ForwardBatch:
    values = {name: getattr(batch, name) for name in (
        "seq_lens_cpu", "req_pool_indices", "req_to_token", "out_cache_loc", "mode",
        "extend_lens_cpu",
    )}  # fmt: skip
    return ForwardBatch(**{**values, **fields})


@pytest.mark.parametrize("backend", ["test-ragged", "nsa"])
def test_bad_values_in_a_padded_ragged_replay_are_named_and_touch_nothing(backend):
    """The device check lets the padding's own pad values through and refuses a bad value
    in the real rows, naming its field, at the read after the graph ran: the plans' source
    fields then hold pads only (no KV slot but the null slot written), and the next good
    batch replays and verifies clean."""
    setup = captured(backend)
    planner, good = setup.planner, _rng_batch()  # 3 requests, 18 tokens, into (6, 48)
    lens, pools, locs = good.seq_lens_cpu, good.req_pool_indices, good.out_cache_loc
    bad = {
        "seq_lens_cpu": _with(good, seq_lens_cpu=lens + torch.tensor([MAX_CTX, 0, 0], dtype=I32)),
        "req_pool_indices": _with(good, req_pool_indices=pools * 0 + TABLE.shape[0]),
        "out_cache_loc": _with(good, out_cache_loc=locs * 0 - 1),
        "extend_lens_cpu": _with(good, extend_lens_cpu=torch.tensor([2, 12, 4], dtype=I32)),
    }
    for field, batch in bad.items():
        plans = setup.replay(batch, 6, 48)  # replay and graph: nothing raised yet
        assert not_pads(planner, plans) == {}, field
        with pytest.raises(BatchError) as err:
            planner.read(torch.arange(batch.num_tokens))
        assert err.value.field == field, (field, err.value)
    planner.verify(good, setup.replay(good, 6, 48))  # the bucket still replays a good batch


def test_a_uniform_replay_takes_no_tokens():
    planner = make_planner("nsa")
    planner.capture(2, DECODE, req_to_token=TABLE)
    batch = ForwardBatch(
        seq_lens_cpu=torch.tensor([5, 9], dtype=I32),
        req_pool_indices=torch.tensor([1, 2], dtype=I32),
        req_to_token=TABLE,
        out_cache_loc=torch.tensor([int(TABLE[1, 4]), int(TABLE[2, 8])], dtype=I32),
    )
    with pytest.raises(BatchError) as err:
        planner.replay(batch, 2, tokens=2)
    assert err.value.field == "tokens"
    with pytest.raises(BatchError) as err:
        planner.plan(batch, pad_to=2, pad_tokens=2)
    assert err.value.field == "pad_tokens"
    planner.replay(batch, 2)  # and without tokens it replays


def test_kv_past_the_bound_is_refused_naming_the_limit():
    planner = make_planner("test-ragged", ragged_kv_tokens=120)
    assert planner.limits.kv_token_capacity == 120
    assert make_planner("test-ragged").limits.kv_token_capacity == MAX_BATCH * MAX_CTX
    planner.capture(4, EXTEND, req_to_token=TABLE, tokens=24)
    batch = _rng_batch()  # 149 KV tokens

    def replay() -> None:
        plans = planner.replay(batch, 4, tokens=24)  # refused in the graph, raised at the read
        planner.record(4, EXTEND, tokens=24)
        assert not_pads(planner, plans) == {}
        planner.read_errors()

    for call in (replay, lambda: planner.plan(batch, pad_to=4, pad_tokens=24)):
        with pytest.raises(BatchError, match="ragged_kv_tokens") as err:
            call()
        assert err.value.field == "seq_lens_cpu" and err.value.expected == "<= 120 in all"
    fits = _batch(random.Random(2), [100, 20], [4, 4])  # 120: at the bound, padding on top
    planner.replay(fits, 4, tokens=24)
    planner.record(4, EXTEND, tokens=24)
    planner.read_errors()
    assert planner.plan(fits, pad_to=4, pad_tokens=24)["test-ragged"].kv_slots.shape == (124,)


PAD_REFUSALS = [
    (dict(pad_tokens=24), "pad_to"),
    (dict(pad_to=4), "pad_tokens"),
    (dict(pad_to=4, pad_tokens=8), "pad_tokens"),  # 18 real tokens
    (dict(pad_to=2, pad_tokens=24), "pad_to"),  # 3 requests
    (dict(pad_to=4, pad_tokens=MAX_TOKENS + 1), "pad_tokens"),
]


@pytest.mark.parametrize("kwargs,field", PAD_REFUSALS)
def test_padded_eager_plans_refuse_what_the_bucket_cannot_hold(kwargs, field):
    with pytest.raises(BatchError) as err:
        make_planner("test-ragged").plan(_rng_batch(), **kwargs)
    assert err.value.field == field


def test_ragged_buffers_count_against_the_budget_only_when_captured_or_bounded():
    probe = make_planner("nsa")
    uniform = sum(probe.storages.static_estimate().values())
    ragged = sum(probe.storages.static_estimate({EXTEND}).values())
    assert ragged > uniform
    planner = make_planner("nsa", max_static_bytes=uniform)  # today's planners still build
    planner.capture(2, DECODE, req_to_token=TABLE)
    with pytest.raises(ConfigError) as err:
        planner.capture(2, EXTEND, req_to_token=TABLE, tokens=8)
    assert err.value.field.startswith("nsa.")
    assert planner.captured_buckets(EXTEND) == []
    with pytest.raises(ConfigError):  # a stated bound counts ragged buffers from the start
        make_planner("nsa", max_static_bytes=uniform, ragged_kv_tokens=MAX_CTX)


def test_a_schema_whose_padding_requests_add_tokens_is_not_captured(isolated_registries):
    class PadOne(Plan, backend="test-ragged-pad-one", modes=RAGGED_MODES):
        extend_lens: Tensor = tensor_field(I32, ("reqs",), source="extend_lens", pad=1)
        qo_indptr: Tensor = tensor_field(
            I32, ("reqs+1",), op="cumsum_with_zero", inputs=("extend_lens",), pad=PAD_DERIVED
        )

    planner = make_planner("test-ragged-pad-one")
    assert planner.plan(_rng_batch()).mode is EXTEND  # eager plans as before
    with pytest.raises(SchemaError) as err:
        planner.capture(2, EXTEND, req_to_token=TABLE, tokens=8)
    assert err.value.field == "test-ragged-pad-one.extend_lens"


def test_a_bucket_needing_more_than_the_sizing_grows_its_field_alone(isolated_registries):
    """A derived dimension largest at few tokens (buffers are sized at the token capacity):
    the bucket gets a larger buffer for that field; earlier buckets keep theirs and stay right."""

    class Grows(RaggedTestPlan, backend="test-ragged-grows"):
        cells: Tensor = tensor_field(
            I32, ("cells",), op="uniform_offsets", params={"step": 3}, pad=PAD_DERIVED
        )

        @classmethod
        def derived_dims(cls, dims, settings):
            return {"cells": max(1, 64 // dims["tokens"])}

    setup = Captured("test-ragged-grows", debug=True)
    storage = setup.planner.storages.static(EXTEND)[0]
    assert storage.buffers[("test-ragged-grows", "cells")].numel() == 16  # 64 // 4, grown
    assert storage.nbytes > sum(t.numel() * 4 for t in storage.buffers.values())  # old kept
    for seed, (bs, tokens) in enumerate([(2, 8), (6, 4), (6, MAX_TOKENS), (2, 8)]):
        batch = _batch(random.Random(seed), [9, 30][: min(bs, 2)], [2, 1][: min(bs, 2)])
        plans = setup.replay(batch, bs, tokens)
        setup.planner.verify(batch, plans)
        assert plans["test-ragged-grows"].cells.tolist() == [
            3 * i for i in range(64 // tokens or 1)
        ]
