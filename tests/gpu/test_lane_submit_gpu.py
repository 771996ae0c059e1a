"""The eager lane's C submission on a real GPU (``planner.lane_submit``): a layout planned
again is staged, copied and launched by one C call through ``cudaMemcpyAsync`` and
``cuLaunchKernel``, and its plans are bit-equal to the general path's, batch after batch,
over new and recycled memory; the driver confirms the fused kernel's parameters; a launch
hook, a failed launch or the raw copy turned off sends plans the Python way, still exact."""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from planner import ForwardMode, lane_submit, notices
from planner.compare import diff_plans
from planner.kernel_launch import param_sizes
from tests.support.faults import runtime_warnings
from tests.support.growing_decode import MAX_CTX, TABLE, decode, growing, small_planner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pair():
    fast, plain = small_planner("cuda"), small_planner("cuda")
    plain._eager_lanes._next_n.clear()
    return fast, plain


def _one_layout(rng: random.Random, bs: int, longest: int, table: torch.Tensor) -> object:
    """A decode batch whose longest request is ``longest`` (so one layout), the rest random,
    its indices on the host and its token table on the GPU."""
    lens = [longest] + [rng.randint(1, longest) for _ in range(bs - 1)]
    rng.shuffle(lens)
    return dataclasses.replace(decode(lens), req_to_token=table)


def _submits(planner, bs: int) -> lane_submit.LaneSubmits:
    return planner.storages.fresh(ForwardMode.DECODE, bs).submits


@pytest.mark.parametrize("bs", [1, 4, 6])
@pytest.mark.parametrize("hold", [0, 3])
def test_a_layout_planned_again_is_submitted_from_c_and_plans_alike(bs, hold):
    """From the third plan of a layout on, one C call; ``hold`` plans kept alive at a time
    (new memory and recycled memory both)."""
    fast, plain = _pair()
    table, rng, held = TABLE.cuda(), random.Random(bs), []
    for step in range(30):
        batch = _one_layout(rng, bs, MAX_CTX - 10, table)
        got, want = fast.plan(batch), plain.plan(batch)
        assert diff_plans(got, want) == []
        held = (held + [got])[-hold:] if hold else []
        assert _submits(fast, bs).used == max(0, step - 1)
    torch.cuda.synchronize()
    assert fast._eager_lanes.taken == 30


def test_the_driver_confirms_the_fused_launch_it_records():
    fast, _ = _pair()
    table, rng = TABLE.cuda(), random.Random(1)
    for _ in range(3):
        fast.plan(_one_layout(rng, 4, 100, table))
    kept = [entry[2] for entry in _submits(fast, 4)._kept.values()]
    assert len(kept) == 1 and kept[0].__class__ is lane_submit.LaneSubmit
    ((function, sizes),) = kept[0].functions
    assert param_sizes(function) == sizes and kept[0].live()


def test_a_growing_decode_makes_no_records_and_plans_alike():
    fast, plain = _pair()
    table = TABLE.cuda()
    for batch in growing(20, bs=4, seed=5):
        batch = dataclasses.replace(batch, req_to_token=table)
        assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    submits = _submits(fast, 4)
    assert submits.used == 0 and not submits._kept  # each layout seen once: no record
    assert len(submits._seen) == 20


def test_a_launch_hook_sends_plans_the_python_way(monkeypatch):
    triton = pytest.importorskip("triton")
    fast, plain = _pair()
    table, rng = TABLE.cuda(), random.Random(2)
    for _ in range(3):
        fast.plan(_one_layout(rng, 4, 120, table))
    used = _submits(fast, 4).used
    assert used == 1
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: seen.append(a))
    batch = _one_layout(rng, 4, 120, table)
    assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    assert _submits(fast, 4).used == used and seen  # Triton launched it, with the hook


def test_a_failed_launch_is_said_once_and_the_plan_finishes_the_python_way(monkeypatch):
    monkeypatch.setattr(notices, "_SAID", set())
    monkeypatch.setitem(lane_submit._state, "on", True)
    fast, plain = _pair()
    table, rng = TABLE.cuda(), random.Random(3)
    for _ in range(3):
        fast.plan(_one_layout(rng, 4, 90, table))
    (submit,) = [e[2] for e in _submits(fast, 4)._kept.values()]
    grid_x = 6 + 1  # the record's first launch: after the head, its function, then grid x
    submit.record[grid_x] = 0  # an empty grid: cuLaunchKernel refuses it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            batch = _one_layout(rng, 4, 90, table)
            assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    said = [m for m in runtime_warnings(caught) if "from C failed" in m]
    assert len(said) == 1 and not lane_submit._state["on"]
    assert _submits(fast, 4).used == 1  # the failed one is not counted; none after it


def _tensors_in(obj, depth: int = 5) -> list:
    """Tensors reachable from ``obj`` through containers, slots, dataclass fields and
    closures."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, (tuple, list)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif callable(obj) and getattr(obj, "__closure__", None):
        items = [cell.cell_contents for cell in obj.__closure__]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        items = [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
    return [t for item in items for t in _tensors_in(item, depth - 1)]


def test_a_record_holds_no_plans_memory():
    """A record keeps offsets, not the tensors it was made from: a reference to one plan's
    views would keep that memory from ever being recycled."""
    fast, _ = _pair()
    table, rng = TABLE.cuda(), random.Random(6)
    for _ in range(2):  # the second plan makes the record
        fast.plan(_one_layout(rng, 4, 70, table))
    (submit,) = [e[2] for e in _submits(fast, 4)._kept.values()]
    assert submit is not None and _tensors_in(submit) == []


@pytest.mark.parametrize("switch", ["raw copy", "lane submit"])
def test_a_switch_turned_off_keeps_the_python_way(monkeypatch, switch):
    from planner import device_copy

    state = device_copy._state if switch == "raw copy" else lane_submit._state
    monkeypatch.setitem(state, "env", False)
    fast, plain = _pair()
    table, rng = TABLE.cuda(), random.Random(4)
    for _ in range(4):
        batch = _one_layout(rng, 4, 80, table)
        assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    assert _submits(fast, 4).used == 0
