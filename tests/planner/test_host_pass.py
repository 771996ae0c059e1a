"""Eager plans' host pass: the fields it computes, bit-equal plans with and without it,
forced providers kept on the device, a failing twin retired, fresh memory per plan."""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from planner import ForwardMode, Limits, Planner, ProviderError
from planner.debug import diff_plans
from tests.planner.test_extend_modes import TABLE as EXTEND_TABLE
from tests.planner.test_extend_modes import extend_batch
from tests.support.batches import make_pool, random_batch
from tests.support.faults import break_host_twin, runtime_warnings

MAX_BATCH, MAX_CTX, PAGE = 6, 256, 64
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=3)
SETUPS = {
    "paged+nsa": (["paged", "nsa"], {"nsa": {"topk": 16}}),
    "flashinfer_decode": (["flashinfer_decode"], {}),
    "flashinfer_mla": (["flashinfer_mla"], {}),
}


def _planner(backends, options, table=TABLE, **kwargs) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        num_sms=8,
        next_n=2,
        kv_slots=int(table.max()) + 1,
    )
    return Planner(backends, limits, options=options, **kwargs)


def _host_fields(planner: Planner, mode: ForwardMode) -> set[str]:
    storage = planner.storages.fresh(mode, 2)
    return {step.key for step, _ in storage.host_pass.steps} if storage.host_pass else set()


def test_decode_computes_every_field_but_the_table_gathers_on_the_host():
    planner = _planner(*SETUPS["paged+nsa"])
    # kv_lens is seq_lens itself in decode (one row per request): no step at all
    assert _host_fields(planner, ForwardMode.DECODE) == {
        "paged.cu_seqlens_k",
        "nsa.cu_seqlens_q",
        "nsa.topk_lens",
        "nsa.schedule",
        "nsa.mla_split_plan",
    }
    extend = _host_fields(planner, ForwardMode.EXTEND)
    assert "nsa.kv_slots" not in extend
    assert {"nsa.qo_indptr", "nsa.kv_ranges", "nsa.topk_lens", "nsa.cache_pages"} <= extend


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE])
def test_eager_plans_are_bit_equal_with_and_without_the_host_pass(setup, mode):
    backends, options = SETUPS[setup]
    on, off = _planner(backends, options), _planner(backends, options, eager_on_host=False)
    rng = random.Random(7)
    for _ in range(12):
        if mode is ForwardMode.IDLE:
            batch = dataclasses.replace(
                random_batch(rng, TABLE, max_batch=1, max_context=MAX_CTX, bs=1),
                seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
                req_pool_indices=torch.zeros(0, dtype=torch.int64),
                out_cache_loc=torch.zeros(0, dtype=torch.int64),
                mode=ForwardMode.IDLE,
            )
        else:
            batch = random_batch(
                rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, next_n=2, mode=mode
            )
        left, right = on.plan(batch), off.plan(batch)
        assert not diff_plans(left, right)
        pad = rng.randint(max(batch.bs, 1), MAX_BATCH)
        assert not diff_plans(on.plan(batch, pad_to=pad), off.plan(batch, pad_to=pad))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_extend_plans_are_bit_equal_with_and_without_the_host_pass(mode):
    backends, options = SETUPS["paged+nsa"]
    on = _planner(backends, options, table=EXTEND_TABLE)
    off = _planner(backends, options, table=EXTEND_TABLE, eager_on_host=False)
    rng = random.Random(11)
    for _ in range(12):
        batch = extend_batch(rng, mode=mode)
        assert not diff_plans(on.plan(batch), off.plan(batch))


def test_a_forced_provider_keeps_its_field_on_the_device():
    backends, options = SETUPS["paged+nsa"]
    planner = _planner(backends, options, providers={"clamp": "torch"})
    assert "nsa.topk_lens" not in _host_fields(planner, ForwardMode.DECODE)
    assert "paged.cu_seqlens_k" in _host_fields(planner, ForwardMode.DECODE)


def test_the_host_twin_cannot_be_forced():
    backends, options = SETUPS["paged+nsa"]
    with pytest.raises(ProviderError) as err:
        _planner(backends, options, providers={"clamp": "numpy"})
    assert err.value.field == "clamp" and "torch" in str(err.value)


def _eager_batches(setup: str, mode: ForwardMode, rng: random.Random):
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return [extend_batch(rng, mode=mode) for _ in range(6)]
    return [
        random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, next_n=2, mode=mode)
        for _ in range(6)
    ]


def test_a_failing_twin_is_retired_once_and_the_plan_redone_on_the_device(monkeypatch):
    backends, options = SETUPS["paged+nsa"]
    calls = break_host_twin(monkeypatch)  # numpy twins alone, one that raises
    planner, reference = (
        _planner(backends, options),
        _planner(backends, options, eager_on_host=False),
    )
    rng = random.Random(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            batch = random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX)
            assert not diff_plans(planner.plan(batch), reference.plan(batch))
    said = [m for m in runtime_warnings(caught) if "host twin failed" in m]
    assert len(said) == 1 and "cumsum_with_zero" in said[0] and len(calls) == 1


def test_eager_plans_never_share_memory_and_keep_their_values():
    backends, options = SETUPS["paged+nsa"]
    planner = _planner(backends, options)
    rng = random.Random(5)
    first_batch = random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=4)
    first = planner.plan(first_batch)
    kept = {k: v.clone() for k, v in first["nsa"].tensors().items()}
    second = planner.plan(random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=4))
    ptrs = {t.data_ptr() for t in second["nsa"].tensors().values()}
    assert not ptrs & {t.data_ptr() for t in first["nsa"].tensors().values()}
    for name, value in first["nsa"].tensors().items():
        assert torch.equal(value, kept[name]), name


def test_an_eager_plan_is_one_allocation_beside_the_batchs_own_tensors():
    backends, options = SETUPS["paged+nsa"]
    planner = _planner(backends, options)
    batch = random_batch(random.Random(8), TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX)
    plans = planner.plan(batch)
    batch_storages = {TABLE.untyped_storage().data_ptr()}
    storages = {
        t.untyped_storage().data_ptr()
        for name in ("paged", "nsa")
        for t in plans[name].tensors().values()
    }
    assert len(storages - batch_storages) == 1
