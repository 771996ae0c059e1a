"""Where an eager plan's tensors live: memory of its own per batch, laid out once per shape.

An eager plan owns its tensors (a later plan never writes memory any of them can still
read), so each batch gets its own staging buffer, which also holds the host pass's
outputs and, after the part copied from the host, the int32 fields computed on the
device; other dtypes get one allocation each. That memory is a dropped plan's where
one's is unobserved (``planner.fresh_pool``, its views already cut), else new.
What is worked out per set of dimensions (offsets, shapes, alignment) is
kept, and the views of new memory are cut in one call: on a GPU host a
slice and a view cost 2-3 us apiece, a dozen fields a few tens of us.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from operator import itemgetter

import numpy as np
import torch

from planner import lane_submit, native
from planner.batch import ForwardBatch
from planner.dims import dim_names, resolve_shape
from planner.fresh_layout import Cuts, FreshLayout, Piece, StagedPart, contiguous_strides
from planner.fresh_pool import FreshPool, Recycled
from planner.fusion import Runnable, fuse_steps
from planner.host_pass import HostPass, HostPassFailed
from planner.lane_submit import LaneSubmits
from planner.program import Key, Program, batch_reads
from planner.stager import Stager
from planner.staging import Ranges, Segment
from planner.staging_screen import BoundScreen

Pending = tuple[FreshLayout, Ranges, torch.Tensor]
"""What :meth:`FreshStorage.learn` takes: a layout, its table's ranges, the plan's buffer."""
_LAYOUT_CACHE = 256
"""Layouts kept per storage; ragged batches vary in shape, so the cache is bounded."""
_ALIGN_BYTES = 256
"""Fields start on 256-byte boundaries, the alignment a separate allocation gives kernels."""
_INT32_ALIGN = _ALIGN_BYTES // 4


class FreshStorage:
    """Eager plans: see the module docstring."""

    static = False

    def __init__(
        self,
        program: Program,
        segments: Mapping[Key, Segment],
        stager: Stager,
        host_pass: HostPass | None,
        retired_fusions: set[tuple[str, str]] | None = None,
    ) -> None:
        self.program = program
        self.segments = segments
        self.stager = stager
        self.host_pass = host_pass
        self.pool = FreshPool(stager.device, program.aliases)
        """Memory of dropped plans, taken back with its views (``planner.fresh_pool``)."""
        self.submits = LaneSubmits()
        """The eager lane's records of the layouts it plans again (``planner.lane_submit``)."""
        self._layouts: dict[tuple, FreshLayout] = {}
        self._staged: dict[tuple, StagedPart] = {}
        # Only the batch tensors the device steps read are bound: with the host pass on,
        # the ragged ops' implied extend lengths are never built (a torch.full per plan).
        self._inputs = {frozenset(): batch_reads(program.steps)}
        if host_pass is not None:
            self._inputs[host_pass.outputs] = batch_reads(program.steps, host_pass.outputs)
        self._device_steps = {
            done: tuple(s for s in program.steps if s.output not in done) for done in self._inputs
        }
        self._device_specs = {
            done: tuple(
                (
                    s.output,
                    s.spec.shape,
                    s.spec.dtype,
                    max(1, _ALIGN_BYTES // s.spec.dtype.itemsize),
                    s.key,
                )
                for s in steps
            )
            for done, steps in self._device_steps.items()
        }
        self._schedules = {
            done: fuse_steps(steps, retired_fusions) for done, steps in self._device_steps.items()
        }
        # The dimensions each part's shapes name, so that a part is laid out again only when
        # one of them changes (a decode's longest request grows every step; its request
        # count, the host pass's shapes' only name, does not).
        # Each key is read in one call (a getter of two names at least, so it gives a tuple).
        host_names = set() if host_pass is None else _names(s for s, _ in host_pass.steps)
        self._keys = {
            done: (
                itemgetter("reqs", "tokens", *sorted(host_names if done else ())),
                itemgetter("reqs", "tokens", *sorted(_names(self._device_steps[done]))),
            )
            for done in self._inputs
        }

    def batch_inputs(self, done: frozenset) -> frozenset[str]:
        """The batch tensors the steps left after the host pass (``done``) read."""
        return self._inputs[done]

    def schedule(self, done: frozenset) -> tuple[Runnable, ...]:
        """The steps left after the host pass (``done``), adjacent fusable pairs joined
        (``planner.fusion``: one launch where two would cost the host twice)."""
        return self._schedules[done]

    def _layout(
        self, dims: Mapping[str, int], reqs: int, host_pass: HostPass | None
    ) -> FreshLayout:
        done = host_pass.outputs if host_pass is not None else frozenset()
        staged_names, device_names = self._keys[done]
        try:
            staged_key = (host_pass is not None, reqs, staged_names(dims))
            key = (staged_key, device_names(dims))
        except KeyError:  # a shape names a dimension not given: resolve_shape names the field
            return self._lay_out(self._stage_part(dims, reqs, host_pass), dims, done)
        layout = self._layouts.get(key)
        if layout is None:
            part = self._staged.get(staged_key)
            if part is None:
                part = _cached(self._staged, staged_key, self._stage_part(dims, reqs, host_pass))
            layout = _cached(self._layouts, key, self._lay_out(part, dims, done))
        return layout

    def _stage_part(
        self, dims: Mapping[str, int], reqs: int, host_pass: HostPass | None
    ) -> StagedPart:
        host, staged_size, compiled = (), self.stager.layout.size, None
        tokens = dims["tokens"]
        if host_pass is not None:
            host, staged_size = host_pass.placements(staged_size, dims)
            compiled = host_pass.native_pass(host, reqs, tokens)
        staged = [
            (key, seg.offset, (tokens if seg.per_token else reqs,))
            for key, seg in self.segments.items()
        ]
        staged += [(p.key, p.offset, p.shape) for p in host]
        sent = self.stager.region_size(staged_size - self.stager.layout.size)
        return StagedPart(tuple(host), compiled, staged_size, sent, Cuts.of(staged, None))

    def _lay_out(self, part: StagedPart, dims: Mapping[str, int], done: frozenset) -> FreshLayout:
        pieces: dict[torch.dtype, list[Piece]] = {}
        totals: dict[torch.dtype, int] = {}
        for output, symbolic, dtype, align, key in self._device_specs[done]:
            shape = resolve_shape(symbolic, dims, field=key)
            start = totals.get(dtype, 0)
            pieces.setdefault(dtype, []).append((output, start, shape, contiguous_strides(shape)))
            totals[dtype] = start + -(-math.prod(shape) // align) * align
        # int32 fields share the staging buffer's allocation, after it: one allocation and
        # one cut for the whole plan (a device allocation costs 5-10 us of host time on a GPU)
        after, device_extra = (), 0
        ints = pieces.pop(torch.int32, None)
        if ints is not None:
            base = -(-part.sent // _INT32_ALIGN) * _INT32_ALIGN
            after = tuple((key, base + at, shape, st) for key, at, shape, st in ints)
            device_extra = base + totals.pop(torch.int32) - part.sent
        arenas = {dt: (totals[dt], tuple(pieces[dt])) for dt in totals}
        return FreshLayout(part, device_extra, after, arenas)

    def prepare(
        self,
        batch: ForwardBatch,
        reqs: int,
        dims: Mapping[str, int],
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool = False,
    ) -> tuple[dict[Key, torch.Tensor], frozenset]:
        """Stage (running the host pass before the copy) and lay out; the tensors, and the
        outputs already computed. A host twin that fails is retired for good and the plan
        redone on the device."""
        host_pass = self._live_pass()
        layout = self._layout(dims, reqs, host_pass)
        part = layout.part
        kept = self.pool.take(layout)
        try:
            staged = self.stager.stage(
                batch,
                reqs,
                dims["tokens"],
                ranges,
                read_device=read_device,
                read_table=read_table,
                extra=self._extra(part),
                host_work=_host_work(part, host_pass, reqs, dims["tokens"]),
                device_extra=layout.device_extra,
                into=None if kept is None else (kept.buffer, kept.host),
            )
        except HostPassFailed:
            return self.prepare(
                batch, reqs, dims, ranges, read_device=read_device, read_table=read_table
            )
        return self._tensors(layout, staged, kept), _done(host_pass)

    def prepare_screened(
        self,
        screen: BoundScreen,
        sources: tuple[int, ...],
        batch: ForwardBatch,
        reqs: int,
        dims: Mapping[str, int],
        ranges: Ranges,
        *,
        read_table: bool,
    ) -> tuple[dict[Key, torch.Tensor], frozenset, bool, Pending | None] | None:
        """:meth:`prepare` for the eager lane (``planner.eager_lane``): ``screen`` fills and
        checks a host batch's staged inputs from ``sources`` (what ``BoundScreen.pack``
        takes), in the same C call as the compiled host pass where there is one, and, where
        this layout has a record (``planner.lane_submit``), as the copy and the device
        steps' launches. The tensors, the outputs computed, whether the steps were launched,
        and what :meth:`learn` takes once the caller ran them (None: nothing to learn).
        None, with nothing sent, where the screen refuses the batch or a host twin fails:
        :meth:`prepare` then runs, and names what is wrong or retires the twin."""
        host_pass = self._live_pass()
        layout = self._layout(dims, reqs, host_pass)
        part = layout.part
        kept = self.pool.take(layout)
        args = screen.pack(*sources)
        into = None if kept is None else (kept.buffer, kept.host)
        extra = self._extra(part)
        on = not read_table and lane_submit.enabled() and self.stager.on_current_device()
        submits = self.submits if on else None
        submit = None if submits is None else submits.ready(layout, ranges)
        if submit is not None:
            redo = None
            if host_pass is not None:

                def redo(view: np.ndarray) -> None:
                    host_pass.run(view, part.host, reqs, dims["tokens"])

            try:
                out = self.stager.submit_fresh(
                    submit,
                    args,
                    batch.req_to_token.data_ptr(),
                    redo,
                    extra=extra,
                    device_extra=layout.device_extra,
                    into=into,
                )
            except HostPassFailed:  # raised by the numpy pass, before anything was sent
                return None
            if out is None:
                return None
            submits.used += out[1]
            return self._tensors(layout, out[0], kept), _done(host_pass), out[1], None
        fill = _fill(screen, args, part, host_pass, reqs, dims["tokens"])
        try:
            staged = self.stager.stage_fresh(
                fill,
                batch,
                ranges,
                read_table=read_table,
                extra=extra,
                device_extra=layout.device_extra,
                into=into,
            )
        except HostPassFailed:
            return None
        if staged is None:
            return None
        wanted = submits is not None and submits.wanted(layout, ranges)
        pending = (layout, ranges, staged) if wanted else None
        return self._tensors(layout, staged, kept), _done(host_pass), False, pending

    def learn(
        self, tensors: Mapping[Key, torch.Tensor], table: torch.Tensor, pending: Pending
    ) -> None:
        """Make the record of a layout from its plan that went the Python way (``pending``
        from :meth:`prepare_screened`; its device steps ran): every step's launch as it
        says it (``prepared``), where each one can; else the layout keeps the Python way."""
        layout, ranges, staged = pending
        part, host_pass = layout.part, self._live_pass()
        compiled = None
        if host_pass is not None:
            if part.native is None:
                self.submits.keep(layout, ranges, None)
                return
            compiled = (part.native.address, len(part.native.records))
        launches = []
        for runnable in self.schedule(_done(host_pass)):
            prepared = getattr(runnable, "prepared", None)
            launch = None if prepared is None else prepared(tensors)
            if launch is None:
                self.submits.keep(layout, ranges, None)
                return
            launches.append(launch)
        size = self.stager.region_size(self._extra(part))
        self.submits.keep(layout, ranges, lane_submit.pack(launches, staged, table, size, compiled))

    def _extra(self, part: StagedPart) -> int:
        """Elements ``part`` stages after the inputs' layout: the host pass's outputs."""
        return part.staged_size - self.stager.layout.size

    def _live_pass(self) -> HostPass | None:
        """The host pass, unless one of its twins failed (it is then retired for good)."""
        host_pass = self.host_pass
        return None if host_pass is None or host_pass.failed else host_pass

    def _tensors(
        self, layout: FreshLayout, staged: torch.Tensor, kept: Recycled | None
    ) -> dict[Key, torch.Tensor]:
        """The plan's tensors: the recycled memory's views (the plan's own dict: the steps
        bind the batch's tensors in it), else views cut in new memory."""
        if kept is not None:
            return dict(kept.views)
        tensors: dict[Key, torch.Tensor] = {}
        layout.staged.views(staged, tensors)
        for dtype, (total, cuts) in layout.arenas.items():
            cuts.views(torch.empty(total, dtype=dtype, device=staged.device), tensors)
        for alias, owner in self.program.aliases.items():
            tensors[alias] = tensors[owner]
        return tensors


def _host_work(
    part: StagedPart, host_pass: HostPass | None, reqs: int, tokens: int
) -> Callable[[np.ndarray, int], None] | None:
    """The host pass as staging calls it, between the fill and the copy: compiled where it
    can run so, else numpy."""
    if host_pass is None:
        return None

    def work(view: np.ndarray, address: int) -> None:
        if part.native is None or not part.native.run(address):
            host_pass.run(view, part.host, reqs, tokens)

    return work


def _fill(
    screen: BoundScreen,
    args: int,
    part: StagedPart,
    host_pass: HostPass | None,
    reqs: int,
    tokens: int,
) -> Callable[[np.ndarray, int], bool]:
    """The eager lane's fill of a region at ``address`` (``view`` its numpy): the bound
    screen over the packed ``args``, then the host pass, in one C call where the pass is
    compiled (``native.screen_and_pass``); False where the screen refused."""
    compiled = host_pass is not None and part.native is not None
    both = native.screen_and_pass() if compiled else None
    if both is not None:
        records, steps = part.native.address, len(part.native.records)

        def fill(view: np.ndarray, address: int) -> bool:
            status = both(address, args, records, steps)
            if status > 0:  # a compiled twin declined: numpy rewrites every output
                host_pass.run(view, part.host, reqs, tokens)
            return status >= 0

        return fill
    fn, work = screen.fn, _host_work(part, host_pass, reqs, tokens)

    def fill(view: np.ndarray, address: int) -> bool:
        if fn(address, args) != 0:
            return False
        if work is not None:
            work(view, address)
        return True

    return fill


def _done(host_pass: HostPass | None) -> frozenset:
    """The outputs the host pass computed (none without one)."""
    return frozenset() if host_pass is None else host_pass.outputs


def _names(steps: Iterable) -> set[str]:
    """The dimension names the steps' output shapes use."""
    return {name for step in steps for name in dim_names(step.spec.shape)}


def _cached(cache: dict, key: tuple, value):
    """``value`` kept under ``key``; the cache is emptied when full (ragged batches vary in
    shape, so it is bounded)."""
    if len(cache) >= _LAYOUT_CACHE:
        cache.clear()
    cache[key] = value
    return value
