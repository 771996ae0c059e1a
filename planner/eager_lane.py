"""The eager lane: a uniform host batch's eager plan with its checks in one pass.

Why: an eager ``plan()`` of a decode batch read every batch tensor twice, once at the
door (``validate_batch``: type, dtype, rank, device, contiguity, length) and once more
to hand the compiled screen its kinds and addresses, and went through the general
paths made for any batch: several steps, ragged lengths, device inputs, padding. On the
H200's host those layers cost about a fifth of a 120 us plan at bs 256 (round 15 of
``docs/benchmarks.md``). The lane takes the batches a serving loop plans eagerly most,
decode and verify batches whose inputs are all on the host, with the door's checks and
the screen's reads done once (``planner.lane_door``), the screen bound once per size
and token table, and the lengths' max and sum in one C call.

It changes nothing but the cost: the same layout, recycled memory, staging, host pass,
device steps and plans as the general path, through the same functions. Anything it does
not recognise as exactly right, and any batch the screen refuses, goes the general way
(None, with nothing sent), whose door and checks name what is wrong. Tests hold its
plans to the general path's, and its refusals to the door's, on random and hostile
batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planner import native
from planner.batch import ForwardBatch, ForwardMode
from planner.lane_door import HostSources, host_sources, table_on
from planner.limits import Limits
from planner.materialise import batch_dims, bind_batch, run_steps
from planner.plan_build import build_plans
from planner.planset import PlanSet
from planner.program import Program
from planner.replay_lane import LANE_MODES
from planner.staging import Ranges
from planner.staging_screen import BoundScreen
from planner.storages import Storages

_BOUND_KEPT = 8
"""Bound screens kept per lane: one per token table shape an engine plans with."""


class EagerLanes:
    """The eager lane of each (mode, size) a planner plans; see the module docstring."""

    def __init__(
        self,
        programs: Mapping[ForwardMode, Program],
        storages: Storages,
        limits: Limits,
        next_n: Mapping[ForwardMode, int],
        device: torch.device,
    ) -> None:
        self._next_n = {mode: next_n.get(mode, 1) for mode in LANE_MODES if mode in programs}
        self._programs, self._storages, self._limits = programs, storages, limits
        self._device, self._on_host = device, device.type == "cpu"
        self._lanes: dict[tuple[ForwardMode, int], EagerLane | None] = {}
        self.taken = 0
        """Eager plans the lane made (tests and reports read it)."""

    def plan(self, batch: object) -> PlanSet | None:
        """The eager plan of ``batch`` where the lane takes it; None where the general path
        must plan it (anything else, a refusal included)."""
        if batch.__class__ is not ForwardBatch or batch.mode.__class__ is not ForwardMode:
            return None
        mode = batch.mode
        next_n = self._next_n.get(mode)
        if next_n is None:
            return None
        sources = host_sources(batch, next_n)
        if sources is None or sources[1] > self._limits.max_batch:
            return None
        table = batch.req_to_token
        if not table_on(table, self._device, self._on_host):
            return None
        key = (mode, sources[1])
        lane = self._lanes.get(key, _MISSING)
        if lane is _MISSING:
            lane = self._lanes[key] = EagerLane.build(
                self._programs[mode], self._storages, self._limits, mode, sources[1]
            )
        if lane is None:
            return None
        plans = lane.plan(batch, sources, table)
        if plans is not None:
            self.taken += 1
        return plans


_MISSING = object()


class EagerLane:
    """One (mode, size)'s eager plan hot path; see the module docstring."""

    __slots__ = (
        "mode",
        "reqs",
        "tokens",
        "next_n",
        "program",
        "storage",
        "storages",
        "page_size",
        "num_sms",
        "screen",
        "max_sum",
        "read_table",
        "_bound",
    )

    def __init__(
        self,
        program: Program,
        storages: Storages,
        limits: Limits,
        mode: ForwardMode,
        reqs: int,
        max_sum: native.MaxSum,
    ) -> None:
        self.mode, self.reqs, self.program, self.storages = mode, reqs, program, storages
        self.next_n = program.next_n
        self.tokens = reqs * program.next_n
        self.storage = storages.fresh(mode, reqs)
        self.page_size, self.num_sms = limits.page_size, limits.num_sms
        self.screen = self.storage.stager.layout.screen
        self.max_sum = max_sum
        # the token table entries are read on the host for free; on a GPU not (a sync)
        self.read_table = storages.device.type != "cuda"
        self._bound: dict[int, tuple[Ranges, BoundScreen]] = {}

    @classmethod
    def build(
        cls,
        program: Program,
        storages: Storages,
        limits: Limits,
        mode: ForwardMode,
        reqs: int,
    ) -> EagerLane | None:
        """The lane of ``reqs`` requests in ``mode``, or None without the compiled screens."""
        max_sum = native.max_sum()
        if max_sum is None:
            return None
        lane = cls(program, storages, limits, mode, reqs, max_sum)
        return lane if lane.screen is not None else None

    def _bound_for(self, ranges: Ranges) -> BoundScreen:
        kept = self._bound.get(id(ranges))
        if kept is None or kept[0] is not ranges:
            if len(self._bound) >= _BOUND_KEPT:
                self._bound.clear()
            bound = self.screen.bind(ranges, self.reqs, self.tokens, self.next_n)
            kept = self._bound[id(ranges)] = (ranges, bound)  # ranges kept: its id is the key
        return kept[1]

    def plan(
        self, batch: ForwardBatch, sources: HostSources, table: torch.Tensor
    ) -> PlanSet | None:
        """The plan of a batch whose door checks ``sources`` passed; None where the screen
        refuses it (or a host twin fails), with nothing sent."""
        seq, real, pool_kind, pool, slot_kind, slot, pos_kind, pos = sources
        seq_ptr = seq.data_ptr()
        max_len, kv_tokens = self.max_sum.int32(seq_ptr, real)
        program = self.program
        dims = batch_dims(
            program,
            self.page_size,
            self.num_sms,
            reqs=real,
            max_len=max_len,
            tokens=self.tokens,
            kv_tokens=kv_tokens,
        )
        ranges = self.storages.ranges(self.mode, table)
        storage = self.storage
        prepared = storage.prepare_screened(
            self._bound_for(ranges),
            (seq_ptr, pool_kind, pool, slot_kind, slot, pos_kind, pos, real),
            batch,
            real,
            dims,
            ranges,
            read_table=self.read_table,
        )
        if prepared is None:
            return None
        tensors, done, launched, pending = prepared
        inputs = storage.batch_inputs(done)
        if launched:  # the device steps were queued with the copy (planner.lane_submit)
            bind_batch(tensors, batch, inputs)
            handles = {}
        else:
            handles = run_steps(storage.schedule(done), tensors, batch, False, inputs=inputs)
            if pending is not None:
                storage.learn(tensors, table, pending)
        return PlanSet(build_plans(program, tensors, handles, dims), "eager", self.mode, real, real)
