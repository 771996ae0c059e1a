"""The compiled staging screen against the Python fill and check it screens for.

Two properties define it: on a batch the screen passes, the staging buffer holds exactly
what the Python path writes (and the Python path passes it too); and it never passes a
batch the Python path refuses. Random uniform batches (decode, verify, int32 and int64
inputs, positions given or derived), then the same batches with one value broken.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import ForwardMode, Limits, Planner, native
from planner.errors import BatchError
from planner.staging import real_counts
from tests.support.batches import make_pool, random_batch

pytestmark = pytest.mark.skipif(
    native.library() is None, reason="no C compiler here: the compiled screen is not built"
)

MAX_BATCH, CONTEXT, PAGE = 8, 256, 64
TABLE = make_pool(2 * MAX_BATCH + 1, CONTEXT, PAGE)
SENTINEL = -12345


def _planner(next_n: int) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=CONTEXT,
        page_size=PAGE,
        next_n=next_n,
        kv_slots=int(TABLE.max()) + 1,
        device="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Planner(["paged", "nsa"], limits, options={"nsa": {"topk": 64}})


PLANNERS = {n: _planner(n) for n in (1, 2, 3)}


def _python(layout, batch, reqs, tokens, ranges) -> np.ndarray | BatchError:
    host = np.full(layout.size, SENTINEL, dtype=np.int32)
    counts = real_counts(batch)
    try:
        on_device = layout.fill(host, batch, reqs, tokens, ranges, read_device=False, counts=counts)
        layout.check(host, batch, ranges, on_device, counts)
    except BatchError as exc:
        return exc
    return host


def _screen(layout, batch, reqs, tokens, ranges) -> np.ndarray | None:
    host = np.full(layout.size, SENTINEL, dtype=np.int32)
    got = layout.screen.run(host.ctypes.data, batch, reqs, tokens, ranges, read_device=False)
    assert got in (None, [])  # host inputs only here: nothing left to copy on a device
    return None if got is None else host


def _case(seed: int, next_n: int, wide: bool, positions: bool):
    rng = random.Random(seed)
    planner = PLANNERS[next_n]
    mode = ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY
    batch = random_batch(
        rng, TABLE, max_batch=MAX_BATCH, max_context=CONTEXT, next_n=next_n, mode=mode,
        positions=positions,
    )  # fmt: skip
    if wide:  # int64 where an engine may give int64
        batch = dataclasses.replace(
            batch,
            out_cache_loc=batch.out_cache_loc.to(torch.int64),
            positions=None if batch.positions is None else batch.positions.to(torch.int64),
        )
    else:
        batch = dataclasses.replace(batch, req_pool_indices=batch.req_pool_indices.int())
    layout = planner.storages.layout(mode, MAX_BATCH)
    ranges = planner.storages.ranges(mode, TABLE)
    reqs = rng.randint(batch.bs, MAX_BATCH)  # padded to a captured size
    return rng, batch, layout, ranges, reqs, reqs * next_n


CASES = dict(
    seed=st.integers(0, 2**31),
    next_n=st.sampled_from([1, 2, 3]),
    wide=st.booleans(),
    positions=st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**CASES)
def test_screen_writes_what_the_python_fill_writes(seed, next_n, wide, positions):
    _, batch, layout, ranges, reqs, tokens = _case(seed, next_n, wide, positions)
    want = _python(layout, batch, reqs, tokens, ranges)
    assert isinstance(want, np.ndarray), want
    got = _screen(layout, batch, reqs, tokens, ranges)
    assert got is not None, "the screen refused a valid batch"
    np.testing.assert_array_equal(got, want)


def _broken(rng: random.Random, batch, ranges):
    """The batch with one value changed to something the checks may refuse."""
    field = rng.choice(["seq_lens_cpu", "req_pool_indices", "out_cache_loc", "positions"])
    tensor = getattr(batch, field)
    if tensor is None:
        tensor = batch.source("positions").clone()
    tensor = tensor.clone()
    i = rng.randrange(tensor.shape[0])
    how = rng.choice(["low", "high", "huge", "copy", "shift", "zero"])
    if how == "low":
        tensor[i] = rng.choice([-1, -(2**31), 0])
    elif how == "high":
        lo, hi = ranges[{"seq_lens_cpu": "seq_lens"}.get(field, field)]
        tensor[i] = hi + rng.choice([0, 1, 7])
    elif how == "huge" and tensor.dtype == torch.int64:
        tensor[i] = rng.choice([2**31, 2**32 + 5, -(2**33)])
    elif how == "copy" and tensor.shape[0] > 1:
        tensor[i] = tensor[(i + 1) % tensor.shape[0]]
    elif how == "shift":
        tensor[i] += rng.choice([-1, 1])
    else:
        tensor[i] = 0
    return dataclasses.replace(batch, **{field: tensor})


def test_screen_never_passes_what_the_python_check_refuses():
    refused = 0
    for seed in range(600):
        rng = random.Random(seed)
        case = _case(seed, rng.choice([1, 2, 3]), rng.random() < 0.5, rng.random() < 0.5)
        rng, batch, layout, ranges, reqs, tokens = case
        bad = _broken(rng, batch, ranges)
        want = _python(layout, bad, reqs, tokens, ranges)
        got = _screen(layout, bad, reqs, tokens, ranges)
        if isinstance(want, BatchError):
            refused += 1
            assert got is None, f"seed {seed}: the screen passed a batch refused with: {want}"
        elif got is not None:  # it may leave a good batch to Python, never stage it wrong
            np.testing.assert_array_equal(got, want)
    assert refused > 300, refused  # the breakages mostly break: the property was exercised


def test_screen_leaves_ragged_batches_to_python():
    _, batch, layout, ranges, reqs, tokens = _case(1, 1, False, True)
    ragged = dataclasses.replace(batch, extend_lens_cpu=torch.ones(batch.bs, dtype=torch.int32))
    assert _screen(layout, ragged, reqs, tokens, ranges) is None


def test_a_failed_build_is_said_once_and_the_planner_keeps_python(monkeypatch, tmp_path):
    monkeypatch.setenv("FORWARD_PLANNER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="compiled staging screen unavailable"):
            assert native.stage_screen() is None
        planner = _planner(1)
        assert planner.storages.layout(ForwardMode.DECODE, MAX_BATCH).screen is None
        batch = random_batch(random.Random(3), TABLE, max_batch=MAX_BATCH, max_context=CONTEXT)
        plans = planner.plan(batch)
        assert plans["nsa"].kv_lens[: batch.bs].tolist() == batch.seq_lens_cpu.tolist()
    finally:
        native.library.cache_clear()


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("FORWARD_PLANNER_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.stage_screen() is None
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("pool", [3, 64])
def test_a_repeated_slot_or_row_is_refused_by_the_bitmap_and_by_the_hash_set(pool):
    """A small table's slots fit a bitmap in the scratch, a large one's take the hash set
    (request rows always fit the bitmap here); either way a repeat is caught."""
    table = make_pool(pool, 64, 64)
    limits = Limits(max_batch=4, max_context=64, kv_slots=int(table.max()) + 1, device="cpu")
    planner = Planner(["paged"], limits)
    layout = planner.storages.layout(ForwardMode.DECODE, 4)
    ranges = planner.storages.ranges(ForwardMode.DECODE, table)
    for seed in range(40):
        rng = random.Random(seed)
        bs = rng.randint(2, min(4, pool - 1))
        batch = random_batch(rng, table, max_batch=4, max_context=64, bs=bs)
        assert _screen(layout, batch, 4, 4, ranges) is not None
        field = rng.choice(["out_cache_loc", "req_pool_indices"])
        tensor = getattr(batch, field).clone()
        tensor[1] = tensor[0]
        bad = dataclasses.replace(batch, **{field: tensor})
        assert isinstance(_python(layout, bad, 4, 4, ranges), BatchError)
        assert _screen(layout, bad, 4, 4, ranges) is None, (seed, field)
