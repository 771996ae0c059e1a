"""The eager lane's C submission (``planner/native/lane_submit.c``, ``planner.lane_submit``)
on the CPU, with stand-ins for ``cudaMemcpyAsync`` and ``cuLaunchKernel`` that record what
they are given: it stages exactly what the screen and the host pass stage, copies once
what the record says to the plan's buffer on the stream given, launches each kernel with
its parameters relocated to this plan's buffer and table, and stops at the first thing
that fails: a refusal sends nothing, a declined twin or a failed copy launches nothing.
Also the record's packing: which tensors it can place and which it refuses."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from planner import ForwardMode, lane_submit, native
from planner.lane_door import host_sources
from planner.lane_submit import (
    COPY_FAILED,
    LAUNCH_FAILED,
    P_DEVICE,
    P_TABLE,
    P_VALUE32,
    P_VALUE64,
    REFUSED,
    SUBMITTED,
    LaneSubmit,
    LaneSubmits,
    _param,
)
from tests.support.lane_cases import CASES, HOSTILE

pytestmark = pytest.mark.skipif(native.lane_submit() is None, reason="no C compiler")

_COPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)


class FakeCuda:
    """Stand-ins that record their calls (the copy really copies) and fail when told."""

    def __init__(self, sizes: list[list[int]], copy_error: int = 0, launch_error: int = 0):
        self.calls: list[tuple] = []
        self.sizes = sizes  # per launch, its parameters' sizes (to read them back)
        self.copy_error, self.launch_error = copy_error, launch_error
        self.copy = _COPY(self._copy)
        self.launch = _LAUNCH(self._launch)

    def _copy(self, dst, src, size, kind, stream):
        self.calls.append(("copy", dst, src, size, kind, stream))
        if not self.copy_error:
            ctypes.memmove(dst, src, size)
        return self.copy_error

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        sizes = self.sizes[sum(c[0] == "launch" for c in self.calls)]
        values = []
        for j, size in enumerate(sizes):
            kind = ctypes.c_int32 if size == 4 else ctypes.c_int64
            values.append(ctypes.cast(params[j], ctypes.POINTER(kind))[0])
        self.calls.append(("launch", fn, (gx, gy, gz), (bx, by, bz), shared, stream, values))
        return self.launch_error

    def addresses(self) -> list[int]:
        return [ctypes.cast(f, ctypes.c_void_p).value for f in (self.copy, self.launch)]


def _lane_and_args(batch_seed: int = 3, hostile: str | None = None):
    """A CPU planner's eager lane of a decode batch, bound; the batch's screen arguments,
    its region size, the compiled host pass's (records, steps) and the planner (which keeps
    the arguments' memory alive)."""
    setup, mode = CASES["nsa+paged decode"]
    planner = setup.planner()
    batch = setup.batch(random.Random(batch_seed), bs=3, positions=True)
    planner.plan(batch)  # makes the lane of this size
    lane = planner._eager_lanes._lanes[(ForwardMode.DECODE, 3)]
    ranges = planner.storages.ranges(mode, batch.req_to_token)
    if hostile is not None:
        batch = HOSTILE[hostile](batch, setup.table)
    sources = host_sources(batch, 1)
    seq, real, *kinds = sources
    args = lane._bound_for(ranges).pack(seq.data_ptr(), *kinds, real)
    storage = lane.storage
    host_pass = storage._live_pass()
    part = storage._layout(_dims(lane, batch), real, host_pass).part
    size = storage.stager.region_size(part.staged_size - storage.stager.layout.size)
    compiled = (part.native.address, len(part.native.records))
    return args, size, compiled, (planner, batch)


def _dims(lane, batch):
    from planner.materialise import batch_dims

    seq = batch.seq_lens_cpu
    return batch_dims(
        lane.program,
        lane.page_size,
        lane.num_sms,
        reqs=seq.numel(),
        max_len=int(seq.max()),
        tokens=lane.tokens,
        kv_tokens=int(seq.sum()),
    )


def _record(fake: FakeCuda, compiled, size: int, launches: list[list[tuple[int, int]]]):
    values = [*fake.addresses(), *compiled, size * 4, len(launches)]
    for k, params in enumerate(launches):
        values += [0x1000 + k, 2 + k, 3, 1, 128, 64 * k, len(params)]
        for kind, value in params:
            values += [kind, value]
    return (ctypes.c_int64 * len(values))(*values)


_PARAMS = [[(P_DEVICE, 256), (P_TABLE, 8), (P_VALUE32, -7), (P_VALUE64, 2**40), (P_VALUE64, 0)]]


def _submit(record, host, args, device, table, stream=77):
    fn = native.lane_submit()
    return fn(ctypes.addressof(record), host.data_ptr(), args, device.data_ptr(), stream, table)


def _reference_fill(args, size, compiled):
    """What the screen and the host pass write, through the round-15 C call."""
    host = torch.zeros(size, dtype=torch.int32)
    assert native.screen_and_pass()(host.data_ptr(), args, *compiled) == 0
    return host


def test_it_stages_copies_once_and_launches_with_this_plans_addresses():
    args, size, compiled, _ = _lane_and_args()
    fake = FakeCuda([[8, 8, 4, 8, 8]] * 2)
    record = _record(fake, compiled, size, _PARAMS * 2)
    host, device = (
        torch.zeros(size, dtype=torch.int32),
        torch.full((size + 64,), -1, dtype=torch.int32),
    )
    table = 0x7000_0000
    assert _submit(record, host, args, device, table) == SUBMITTED
    assert torch.equal(host, _reference_fill(args, size, compiled))
    assert torch.equal(device[:size], host) and (device[size:] == -1).all()
    copy, *launches = fake.calls
    assert copy == ("copy", device.data_ptr(), host.data_ptr(), size * 4, 1, 77)
    assert len(launches) == 2
    for k, call in enumerate(launches):
        assert call[:6] == ("launch", 0x1000 + k, (2 + k, 3, 1), (128, 1, 1), 64 * k, 77)
        assert call[6] == [device.data_ptr() + 256, table + 8, -7, 2**40, 0]


@pytest.mark.parametrize("hostile", ["repeated slot", "wrong positions"])
def test_a_refused_batch_sends_and_launches_nothing(hostile):
    args, size, compiled, _ = _lane_and_args(hostile=hostile)
    fake = FakeCuda([[8, 8, 4, 8, 8]])
    record = _record(fake, compiled, size, _PARAMS)
    host, device = torch.zeros(size, dtype=torch.int32), torch.zeros(size, dtype=torch.int32)
    assert _submit(record, host, args, device, 0) == REFUSED
    assert fake.calls == []


def test_a_failed_copy_launches_nothing_and_a_failed_launch_stops_the_rest():
    args, size, compiled, _ = _lane_and_args()
    host, device = torch.zeros(size, dtype=torch.int32), torch.zeros(size, dtype=torch.int32)
    fake = FakeCuda([[8, 8, 4, 8, 8]] * 2, copy_error=700)
    assert _submit(_record(fake, compiled, size, _PARAMS * 2), host, args, device, 0) == (
        COPY_FAILED
    )
    assert [c[0] for c in fake.calls] == ["copy"]
    fake = FakeCuda([[8, 8, 4, 8, 8]] * 2, launch_error=1)
    assert _submit(_record(fake, compiled, size, _PARAMS * 2), host, args, device, 0) == (
        LAUNCH_FAILED
    )
    assert [c[0] for c in fake.calls] == ["copy", "launch"]


def test_a_declined_twin_sends_nothing():
    """A host pass whose first step's record names a function that declines: its index,
    and no copy (the caller reruns the pass in numpy, then copies)."""
    args, size, compiled, _ = _lane_and_args()
    decline = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda b, r: 1)
    records = (ctypes.c_int64 * native.TWIN_RECORD)(ctypes.cast(decline, ctypes.c_void_p).value)
    fake = FakeCuda([])
    record = _record(fake, (ctypes.addressof(records), 1), size, [])
    host, device = torch.zeros(size, dtype=torch.int32), torch.zeros(size, dtype=torch.int32)
    assert _submit(record, host, args, device, 0) == 1
    assert fake.calls == []


def test_the_record_places_tensors_in_the_plans_buffer_or_the_table_only():
    buffer, table = torch.zeros(1024, dtype=torch.int32), torch.zeros(8, 64, dtype=torch.int32)
    inside = buffer[256:512].view(4, 64)
    assert _param(inside, 8, buffer, table) == (P_DEVICE, 1024)
    assert _param(table[2:], 8, buffer, table) == (P_TABLE, 2 * 64 * 4)
    assert _param(torch.zeros(4, dtype=torch.int32), 8, buffer, table) is None  # elsewhere
    assert _param(buffer[:10], 4, buffer, table) is None  # a pointer is 8 bytes
    small = buffer[:100]
    assert _param(buffer[50:200], 8, small, table) is None  # runs past the buffer's end
    assert _param(5, 4, buffer, table) == (P_VALUE32, 5)
    assert _param(2**31, 4, buffer, table) is None
    assert _param(2**31, 8, buffer, table) == (P_VALUE64, 2**31)
    assert _param(True, 4, buffer, table) is None and _param(1.0, 8, buffer, table) is None


def test_a_layout_gets_its_record_on_its_second_plan_only():
    submits, layout, ranges = LaneSubmits(), object(), object()
    assert not submits.wanted(layout, ranges)  # first plan: noted
    assert submits.wanted(layout, ranges)  # second: make it
    submits.keep(layout, ranges, None)  # could not be made
    assert not submits.wanted(layout, ranges) and submits.ready(layout, ranges) is None
    other = object()
    assert not submits.wanted(other, ranges) and submits.ready(other, ranges) is None


def test_layouts_seen_once_do_not_push_out_the_records_of_those_that_come_back():
    """A growing decode notes a new layout every step; the one planned again keeps its
    record however many go by."""
    submits, ranges, layout = LaneSubmits(), object(), object()
    submits.wanted(layout, ranges)
    assert submits.wanted(layout, ranges)
    record = object.__new__(LaneSubmit)  # stands for a made record
    submits.keep(layout, ranges, record)
    passing = [object() for _ in range(500)]  # kept alive: ids are not reused
    for other in passing:
        assert not submits.wanted(other, ranges)
    assert submits._kept[(id(layout), id(ranges))][2] is record
    assert len(submits._seen) <= 64


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("1", True), (None, True)])
def test_the_environment_switch_is_read_once(monkeypatch, value, on):
    monkeypatch.setitem(lane_submit._state, "env", None)
    monkeypatch.setitem(lane_submit._state, "on", True)
    if value is None:
        monkeypatch.delenv("FORWARD_PLANNER_LANE_SUBMIT", raising=False)
    else:
        monkeypatch.setenv("FORWARD_PLANNER_LANE_SUBMIT", value)
    assert lane_submit.enabled() is on
    monkeypatch.setenv("FORWARD_PLANNER_LANE_SUBMIT", "1" if not on else "0")
    assert lane_submit.enabled() is on  # not read again
