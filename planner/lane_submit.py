"""The eager lane's screen, host pass, copy and kernel launches as one C call, per layout.

Why: with the screen and the host pass in one C call (round 15), an eager decode plan at
bs 256 still spent about 30 us of the H200's host in Python for two things whose every
argument its layout fixes: the staging copy's runtime call and its one fused kernel
launch through Triton's launcher. A layout that comes back (the same batch shape planned
again) gets a record here, made from a plan of it that went the Python way: the copy's
size, the compiled host pass, and each device step's launch (``planner.kernel_launch``)
with its tensors turned into offsets from the plan's device buffer or the token table.
``lane_submit.c`` then does all of it, on the current stream, given the addresses that
change per plan.

Nothing changes but the cost: the same bytes are copied and the same kernels run with the
same arguments as the Python way (tests hold the plans bit for bit to the general path's).
A layout is given a record only on its second plan, so a decode growing a token a step
(a new layout each step) pays nothing for it; a step that cannot say its launch, a tensor
in neither buffer, or a driver that does not confirm the parameters leaves the layout the
Python way. A failed CUDA call turns the record path off for good, with a notice, and
that plan finishes the Python way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from planner import device_copy, native
from planner.env_switch import switch_on
from planner.kernel_launch import KernelLaunch, launch_address, matches_driver
from planner.notices import warn_once

P_VALUE32, P_VALUE64, P_DEVICE, P_TABLE = 0, 1, 2, 3
"""A parameter's kind in a record (``lane_submit.c``)."""
SUBMITTED, REFUSED, COPY_FAILED, LAUNCH_FAILED = 0, -1, -2, -3
"""What ``fp_lane_submit`` answers (a positive answer: that host twin declined)."""
_KEPT = 64
"""Layouts a storage keeps records for, and first sightings it keeps (each apart)."""

_state: dict[str, bool | None] = {"on": True, "env": None}
"""``on``: False after a submission's CUDA call failed (every plan then goes the Python
way); ``env``: what ``FORWARD_PLANNER_LANE_SUBMIT`` said at the first plan (None: not read)."""


def enabled() -> bool:
    """Whether the eager lane may submit from C: no call failed, and
    ``FORWARD_PLANNER_LANE_SUBMIT`` is not 0 (read at the first plan)."""
    return bool(_state["on"]) and switch_on(_state, "FORWARD_PLANNER_LANE_SUBMIT")


class LaneSubmit:
    """One layout's record, and what must still hold for it at each plan."""

    __slots__ = ("record", "address", "fn", "checks", "functions")

    def __init__(self, record: ctypes.Array, fn, launches: Sequence[KernelLaunch]) -> None:
        self.record = record
        self.address = ctypes.addressof(record)
        self.fn = fn
        # Only the checks and what tests and reports read are kept: the launches' tensors
        # are views of one plan's memory, which a reference would keep from ever being
        # recycled (``planner.fresh_pool`` counts them).
        self.checks = tuple(launch.live for launch in launches)
        self.functions = tuple(
            (launch.function, tuple(size for _, size in launch.params)) for launch in launches
        )
        """Per launch: its function and its parameters' sizes."""

    def live(self) -> bool:
        """Whether every launch's own check holds (a profiler's launch hook set since, say);
        the caller has asked :func:`enabled` already, once per plan."""
        for check in self.checks:  # noqa: SIM110 (a generator's cost, per plan)
            if not check():
                return False
        return True

    def __call__(self, host: int, args: int, device: int, stream: int, table: int) -> int:
        """``fp_lane_submit`` of this record; its answer (``SUBMITTED`` and so on)."""
        return self.fn(self.address, host, args, device, stream, table)


def failed(status: int) -> None:
    """Turn the record path off for good after ``status`` (a copy or a launch failed)."""
    _state["on"] = False
    what = "staging copy" if status == COPY_FAILED else "kernel launch"
    warn_once(
        f"forward-planner: the eager lane's {what} from C failed; eager plans queue their "
        "copy and launches from Python from now on"
    )


def pack(
    launches: Sequence[KernelLaunch],
    device: torch.Tensor,
    table: torch.Tensor,
    copy_elements: int,
    host_pass: tuple[int, int] | None,
) -> LaneSubmit | None:
    """The record of a layout whose plan's device buffer is ``device`` (its first
    ``copy_elements`` int32 staged from the host) and token table ``table``; ``host_pass``
    the compiled pass's (records' address, steps). None where the C call is unavailable or
    a launch cannot be recorded (a tensor in neither buffer, a size the driver does not
    confirm, more parameters than the C takes)."""
    fn = native.lane_submit()
    copy, launch = device_copy.memcpy_address(), launch_address()
    if fn is None or copy is None or launch is None or not enabled():
        return None
    values = [copy, launch, *(host_pass or (0, 0)), copy_elements * 4, len(launches)]
    _, launch_head, max_params = native.LANE_HEADS
    for kernel in launches:
        if len(kernel.params) > max_params or not matches_driver(kernel):
            return None
        head = [kernel.function, *kernel.grid, kernel.block, kernel.shared, len(kernel.params)]
        if len(head) != launch_head:  # a grid of other than three sizes
            return None
        values += head
        for value, size in kernel.params:
            param = _param(value, size, device, table)
            if param is None:
                return None
            values += param
    record = (ctypes.c_int64 * len(values))(*values)
    return LaneSubmit(record, fn, launches)


def _param(
    value: torch.Tensor | int, size: int, device: torch.Tensor, table: torch.Tensor
) -> tuple[int, int] | None:
    """A parameter's (kind, value): an int of its size, or a tensor's offset from the start
    of the plan's buffer or of the token table (None: in neither)."""
    if isinstance(value, torch.Tensor):
        if size != 8:
            return None
        for kind, base in ((P_DEVICE, device), (P_TABLE, table)):
            if _inside(value, base):
                return kind, value.data_ptr() - base.data_ptr()
        return None
    if type(value) is not int:
        return None
    if size == 4 and -(2**31) <= value < 2**31:
        return P_VALUE32, value
    if size == 8 and -(2**63) <= value < 2**63:
        return P_VALUE64, value
    return None


def _inside(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in ``base``'s own elements (one storage, within its span)."""
    if tensor.device != base.device or tensor.untyped_storage().data_ptr() != (
        base.untyped_storage().data_ptr()
    ):
        return False
    start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    first, last = tensor.data_ptr(), tensor.data_ptr() + (span + 1) * tensor.element_size()
    return tensor.numel() == 0 or (start <= first and last <= end)


class LaneSubmits:
    """A storage's records, by layout and token table ranges (see the module docstring).

    Layouts seen once are noted apart from the records: a growing decode notes a new one
    every step, and clearing those notes when they fill up must not drop the records of
    the layouts that do come back."""

    def __init__(self) -> None:
        self.used = 0
        """Plans submitted by a record (tests and reports read it)."""
        self._seen: dict[tuple[int, int], tuple[object, object]] = {}
        self._kept: dict[tuple[int, int], tuple[object, object, LaneSubmit | None]] = {}

    def ready(self, layout: object, ranges: object) -> LaneSubmit | None:
        """The record of ``layout`` with ``ranges``, where there is one and it may be used."""
        kept = self._kept.get((id(layout), id(ranges)))
        if kept is None or kept[0] is not layout or kept[1] is not ranges:
            return None
        submit = kept[2]
        return submit if submit is not None and submit.live() else None

    def wanted(self, layout: object, ranges: object) -> bool:
        """Whether a plan of ``layout`` that went the Python way should make its record: on
        the layout's second such plan (the first is only noted), and once only."""
        key = (id(layout), id(ranges))
        kept = self._kept.get(key)
        if kept is not None and kept[0] is layout and kept[1] is ranges:
            return False  # made already (or could not be)
        seen = self._seen.get(key)
        if seen is not None and seen[0] is layout and seen[1] is ranges:
            del self._seen[key]
            return True
        if len(self._seen) >= _KEPT:
            self._seen.clear()
        self._seen[key] = (layout, ranges)
        return False

    def keep(self, layout: object, ranges: object, submit: LaneSubmit | None) -> None:
        """``submit`` (None: none can be made; not tried again) for ``layout``."""
        if len(self._kept) >= _KEPT:
            self._kept.clear()
        self._kept[(id(layout), id(ranges))] = (layout, ranges, submit)
