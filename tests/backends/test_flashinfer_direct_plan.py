"""Graph slots re-planned by FlashInfer's scheduler alone (``backends.flashinfer.direct_plan``).

FlashInfer is replaced by a fake shaped like flashinfer-python 0.5.3's wrappers: ``plan()``
checks, copies the host tables into the bound buffers and calls a compiled scheduler
(``_cached_module.plan``), which writes its schedule into the pinned workspace and returns
the plan info. The fake scheduler's output depends on every argument, so a direct call
that passed anything differently would be caught by the capture-time proof. The GPU test
(``tests/gpu/test_flashinfer_gpu.py``) checks the same against the real wrappers.
"""

from __future__ import annotations

import random
import warnings
import zlib
from types import SimpleNamespace

import pytest
import torch

from backends.flashinfer import direct_plan, release_wrappers
from planner import ForwardMode, errors
from tests.support.fake_flashinfer import install_fake_flashinfer
from tests.support.planners import PlannerSetup, replay_smallest

MAX_BATCH, MAX_CTX, PAGE = 8, 300, 64
SIZES = [1, 2, 4, MAX_BATCH]
SETUP = PlannerSetup(
    ("flashinfer_decode", "flashinfer_mla"),
    MAX_BATCH,
    MAX_CTX,
    PAGE,
    pool=24,
    seed=3,
    options={
        "flashinfer_decode": {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        "flashinfer_mla": {"num_heads": 2},
    },
)


class _Scheduler:
    """The compiled scheduler: a digest of every argument into the pinned workspace."""

    def __init__(self) -> None:
        self.calls = 0

    def plan(self, float_ws, int_ws, pinned, *args):
        self.calls += 1
        words = []
        for a in args:
            if isinstance(a, torch.Tensor):
                words += a.to(torch.int64).tolist() if a.numel() else [str(a.dtype)]
            else:
                words.append(a)
        # crc32, not hash(): str hashes change per process and collide mod 251 in some
        digest = [zlib.crc32(str(w).encode()) % 251 for w in words]
        pinned[: len(digest)] = torch.tensor(digest, dtype=torch.uint8)
        return [len(words), sum(digest)]


class _Wrapper:
    """0.5.3's graph-wrapper attributes, and a ``plan()`` that copies, then schedules."""

    made: list[_Wrapper] = []

    def __init__(self, use_cuda_graph: bool, buffers: dict) -> None:
        self._use_cuda_graph = use_cuda_graph
        self._float_workspace_buffer = torch.zeros(8)
        self._int_workspace_buffer = torch.zeros(8)
        self._pin_memory_int_workspace_buffer = torch.zeros(4096, dtype=torch.uint8)
        self._buffers = buffers
        self._cached_module = None
        self._plan_info = None
        self.full_plans = 0
        _Wrapper.made.append(self)

    def _copy(self, names, values) -> None:
        for name, value in zip(names, values, strict=True):
            if self._use_cuda_graph:
                self._buffers[name].copy_(value)


class _Decode(_Wrapper):
    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, **kw):
        bufs = {
            "indptr": kw.get("paged_kv_indptr_buffer"),
            "last": kw.get("paged_kv_last_page_len_buffer"),
        }
        super().__init__(use_cuda_graph, bufs)
        self._use_tensor_cores = use_tensor_cores
        self._backend = "auto"

    def plan(self, indptr, indices, last, heads, kv_heads, dim, page, *, q_data_type,
             kv_data_type, sm_scale, non_blocking):  # fmt: skip
        self.full_plans += 1
        self._copy(("indptr", "last"), (indptr, last))
        self._cached_module = SCHEDULER
        self._window_left, self._logits_soft_cap = -1, 0.0
        self._plan_info = SCHEDULER.plan(
            *self._ws(), indptr, len(last), heads, kv_heads, page, self._use_cuda_graph, -1,
            0.0, dim, dim, torch.empty(0, dtype=q_data_type), torch.empty(0, dtype=kv_data_type),
        )  # fmt: skip

    def _ws(self):
        return (
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer,
        )


class _MLA(_Decode):
    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):  # fmt: skip
        _Wrapper.__init__(
            self, use_cuda_graph, {"qo": qo_indptr, "indptr": kv_indptr, "lens": kv_len_arr}
        )

    def plan(self, qo, indptr, indices, lens, heads, ckv, kpe, page, causal, scale, q_dtype,
             kv_dtype):  # fmt: skip
        self.full_plans += 1
        self._copy(("qo", "indptr", "lens"), (qo, indptr, lens))
        self._cached_module = SCHEDULER
        self._plan_info = SCHEDULER.plan(*self._ws(), qo, indptr, lens, heads, ckv, causal)


SCHEDULER = _Scheduler()


@pytest.fixture
def fake(monkeypatch):
    release_wrappers()
    _Wrapper.made.clear()
    yield install_fake_flashinfer(
        monkeypatch, BatchDecodeWithPagedKVCacheWrapper=_Decode, BatchMLAPagedAttentionWrapper=_MLA
    )
    release_wrappers()


def _planner():
    return SETUP.planner(providers={"flashinfer_plan": "flashinfer"})


def _full_plan_of(slot) -> tuple[list, torch.Tensor]:
    """What FlashInfer's own plan() makes of the slot's current host arrays."""
    w = slot.wrapper
    w._pin_memory_int_workspace_buffer.fill_(0)
    slot._plan_wrapper(slot.bound[2])
    w.full_plans -= 1  # the check's own call
    return list(w._plan_info), w._pin_memory_int_workspace_buffer.clone()


def test_graph_slots_replay_through_the_proven_scheduler_call(fake):
    planner = _planner()
    captured = {bs: planner.capture(bs, req_to_token=SETUP.table) for bs in SIZES}
    slots = [p[b].wrapper.slot for p in captured.values() for b in p]
    assert all(slot.direct is not None for slot in slots)
    # capture: its own plan, the proof's, and this batch's again
    assert all(slot.wrapper.full_plans == 3 for slot in slots)
    rng = random.Random(7)
    for _ in range(12):
        bs, plans = replay_smallest(planner, SETUP.batch(rng), SIZES)
        for backend in plans:
            slot = plans[backend].wrapper.slot
            assert slot.wrapper.full_plans == 3  # no plan() in a replay
            w = slot.wrapper
            w._pin_memory_int_workspace_buffer.fill_(0)
            slot.direct(slot.args)
            got = list(w._plan_info), w._pin_memory_int_workspace_buffer.clone()
            want = _full_plan_of(slot)
            assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_a_scheduler_call_that_plans_differently_keeps_plan(fake, monkeypatch):
    real = direct_plan._decode

    def skewed(wrapper, config):
        wrapper._window_left = 7  # a direct call passing one argument differently
        return real(wrapper, config)

    monkeypatch.setattr(direct_plan, "_decode", skewed)
    monkeypatch.setattr(errors, "_SAID", set())
    planner = SETUP.planner(["flashinfer_decode"], providers={"flashinfer_plan": "flashinfer"})
    with pytest.warns(RuntimeWarning, match="planned differently"):
        plans = planner.capture(2, req_to_token=SETUP.table)
    slot = plans["flashinfer_decode"].wrapper.slot
    assert slot.direct is None
    planner.replay(SETUP.batch(random.Random(1), bs=2), 2)
    assert slot.wrapper.full_plans == 4  # capture's three, then plan() in the replay


def test_a_scheduler_that_refuses_the_call_keeps_plan(fake, monkeypatch):
    def refuse(*args, **kwargs):
        raise TypeError("plan() takes 14 positional arguments")

    module = SimpleNamespace(plan=refuse)
    real = direct_plan._mla

    def with_refusing_module(wrapper, config):
        saved = wrapper._cached_module
        wrapper._cached_module = module
        try:
            return real(wrapper, config)
        finally:
            wrapper._cached_module = saved

    monkeypatch.setattr(direct_plan, "_mla", with_refusing_module)
    monkeypatch.setattr(errors, "_SAID", set())
    planner = SETUP.planner(["flashinfer_mla"], providers={"flashinfer_plan": "flashinfer"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plans = planner.capture(4, req_to_token=SETUP.table)
    assert any("direct scheduler call failed" in str(w.message) for w in said)
    assert plans["flashinfer_mla"].wrapper.slot.direct is None


def test_eager_slots_always_use_plan(fake):
    planner = _planner()
    rng = random.Random(2)
    for _ in range(3):
        plans = planner.plan(SETUP.batch(rng))
        for backend in plans:
            assert plans[backend].wrapper.slot.direct is None
    assert all(not w._use_cuda_graph for w in _Wrapper.made)
    assert sum(w.full_plans for w in _Wrapper.made) == 6


def test_probe_lengths_exercise_the_scheduler():
    lens = direct_plan.probe_lengths(8, 160, 1)
    assert int(lens.max()) == 160 and int(lens.min()) >= 1 and len(set(lens.tolist())) > 4
    assert direct_plan.probe_lengths(1, 160, 2).tolist() == [160]
    verify = direct_plan.probe_lengths(5, 3, 2)
    assert verify.tolist()[0] == 3 and int(verify.min()) >= 2


def test_target_verify_slots_are_proven_too(fake):
    planner = SETUP.planner(
        ["flashinfer_mla"], next_n=2, providers={"flashinfer_plan": "flashinfer"}
    )
    plans = planner.capture(4, ForwardMode.TARGET_VERIFY, req_to_token=SETUP.table)
    assert plans["flashinfer_mla"].wrapper.slot.direct is not None


def test_each_replay_plans_each_graph_slot_once_through_the_proven_call(fake):
    """The provider, called with ``static=True`` over the captured tensors, finds the slot
    its capture made and re-plans it through the direct call: once per replay and backend,
    no ``plan()``, the captured handle and plans handed back, the summary this batch's."""
    planner = _planner()
    captured = {bs: planner.capture(bs, req_to_token=SETUP.table) for bs in SIZES}
    handles = {(bs, b): p[b].wrapper for bs, p in captured.items() for b in p}
    calls = {}
    for key, handle in handles.items():
        slot, proven = handle.slot, handle.slot.direct

        def counted(args, key=key, proven=proven):
            calls[key] = calls.get(key, 0) + 1
            proven(args)

        slot.direct = counted
    rng = random.Random(11)
    for _ in range(8):
        calls.clear()
        batch = SETUP.batch(rng)
        bs, plans = replay_smallest(planner, batch, SIZES)
        assert plans is captured[bs]
        assert calls == {(bs, b): 1 for b in plans}
        lens = batch.seq_lens_cpu.tolist() + [1] * (bs - batch.bs)
        pages = sum(-(-n // PAGE) for n in lens)
        for backend in plans:
            assert plans[backend].wrapper is handles[(bs, backend)]
            assert plans[backend].wrapper.slot.wrapper.full_plans == 3
            assert plans[backend].plan_info.tolist() == [bs, pages, sum(lens), max(lens)]
