"""Where plan tensors live: each eager plan's own memory, or the static buffers a graph reads.

The phases differ only here and in which steps they run. An eager plan owns its tensors
(:class:`FreshStorage`): no later plan writes memory that any of them can still read, so each
batch gets a new device buffer holding its staged inputs, the host pass's outputs and its
int32 fields computed on the device (one allocation for the whole plan), and one allocation
per other dtype. Captured plans are views of max-size buffers a CUDA graph reads
(:class:`StaticStorage`), made once per size and handed out again on every replay.

:class:`Storages` keeps a planner's layouts, storages and input ranges, sized from its
limits, and refuses limits whose static buffers would not fit their budget before any is
allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter

import torch

from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ConfigError
from planner.host_pass import HostPass, HostPassFailed, Placement, Switch, host_pass_for
from planner.limits import Limits
from planner.program import Key, Program, Step, batch_dims, batch_reads
from planner.schema import TensorSpec, dim_names, resolve_shape
from planner.staging import (
    CopyTransport,
    Ranges,
    Segment,
    Stager,
    StagingLayout,
    TransportFactory,
    input_ranges,
)

Tensors = dict[Key, torch.Tensor]
_LAYOUTS_KEPT = 256
"""Eager layouts kept per storage: ragged batches vary in shape, so the cache is bounded."""
_ALIGN_BYTES = 256
"""Fields start on 256-byte boundaries, the alignment a separate allocation gives kernels."""


def source_segments(program: Program, layout: StagingLayout) -> dict[Key, Segment]:
    """The staging segment each source field of every schema reads."""
    out = {}
    for backend, cls in program.schemas.items():
        for name, spec in cls.tensor_specs.items():
            if spec.source is not None:
                out[(backend, name)] = layout.segments[(spec.source, program.pads[(backend, name)])]
    return out


Piece = tuple[Key, int, tuple[int, ...]]
"""``(key, offset, shape)``: one field's contiguous view of a buffer."""


@dataclass(frozen=True)
class Cuts:
    """Views of one buffer in one ``split_with_sizes`` call (a slice and a view cost a few
    microseconds apiece on a GPU host): the pieces, the gaps between them, and which field
    takes which piece (several fields may share one: a staged source, an alias)."""

    sizes: tuple[int, ...] = ()
    picks: tuple[tuple[Key, int, tuple[int, ...]], ...] = ()
    end: int = 0
    """Where the pieces end: :meth:`then` cuts more after it."""

    def then(self, pieces: Iterable[Piece], total: int | None) -> Cuts:
        """These cuts, then ``pieces`` (none before :attr:`end`), then a last gap up to
        ``total`` (None: none, more pieces to follow). A plan's device fields are cut after
        its staged part, which stays the same while a decode's lengths grow."""
        sizes, picks, at = list(self.sizes), list(self.picks), self.end
        index: dict[tuple[int, int], int] = {}
        for key, offset, shape in sorted(pieces, key=lambda p: p[1]):
            where = (offset, math.prod(shape))
            if where not in index:
                if offset > at:
                    sizes.append(offset - at)
                index[where] = len(sizes)
                sizes.append(where[1])
                at = offset + where[1]
            picks.append((key, index[where], shape))
        if total is not None and total > at:
            sizes.append(total - at)
            at = total
        return Cuts(tuple(sizes), tuple(picks), at)

    def views(self, buffer: torch.Tensor, out: Tensors) -> None:
        parts = buffer.split_with_sizes(self.sizes)
        for key, piece, shape in self.picks:
            part = parts[piece]
            out[key] = part if len(shape) == 1 else part.view(shape)


@dataclass(frozen=True)
class StagedPart:
    """What a plan's staged region holds: the inputs, then the host pass's outputs, placed
    by the dimensions the host pass's shapes name (the request count, the SMs: fixed while a
    decode's lengths grow), and their cuts, open for the device fields after them."""

    host: tuple[Placement, ...]
    sent: int
    """int32 elements one copy sends: the inputs' layout and the host pass's outputs."""
    cuts: Cuts


@dataclass(frozen=True)
class FreshLayout:
    """One set of dimensions of an eager plan: where each field lives in its memory."""

    host: tuple[Placement, ...]
    """The host pass's outputs, after the staged inputs."""
    extra: int
    """int32 elements the host pass writes after the inputs (sent with them)."""
    device_extra: int
    """int32 elements of device-computed fields after the staged ones, never copied."""
    cuts: Cuts
    """The views of the int32 buffer: inputs, host outputs, device fields."""
    arenas: tuple[tuple[torch.dtype, int, Cuts], ...]
    """Every other dtype's fields: one allocation of that many elements each."""

    def views(self, staged: torch.Tensor, aliases: Mapping[Key, Key]) -> Tensors:
        tensors: Tensors = {}
        self.cuts.views(staged, tensors)
        for dtype, total, cuts in self.arenas:
            cuts.views(torch.empty(total, dtype=dtype, device=staged.device), tensors)
        for alias, owner in aliases.items():
            tensors[alias] = tensors[owner]
        return tensors


class _Storage:
    """What both storages hold: the mode's program, where its sources are staged, and the
    stager that stages them."""

    static: bool

    def __init__(self, program: Program, segments: Mapping[Key, Segment], stager: Stager) -> None:
        self.program, self.segments, self.stager = program, segments, stager


class FreshStorage(_Storage):
    """Eager plans of one (mode, request count): see the module docstring."""

    static = False

    def __init__(
        self,
        program: Program,
        segments: Mapping[Key, Segment],
        stager: Stager,
        *,
        host_pass: HostPass | None,
    ) -> None:
        super().__init__(program, segments, stager)
        self.host_pass = host_pass
        self._layouts: dict[tuple, FreshLayout] = {}
        done_sets = [frozenset()] + ([host_pass.outputs] if host_pass is not None else [])
        self._device_steps = {
            done: tuple(s for s in program.steps if s.output not in done) for done in done_sets
        }
        # Only the batch tensors the device steps read are bound: with the host pass on, the
        # ragged ops' implied extend lengths are never built (a torch.full per plan).
        self._inputs = {done: batch_reads(program.steps, done) for done in done_sets}
        names = set().union(*(dim_names(x.shape) for s in program.steps for x in s.specs))
        self._key = itemgetter("reqs", "tokens", *sorted(names))
        """The dimensions a layout depends on, read in one call (a tuple: two names at least)."""
        host_names = set()
        if host_pass is not None:
            host_names = set().union(
                *(dim_names(x.shape) for s, _ in host_pass.steps for x in s.specs)
            )
        self._staged_key = itemgetter("reqs", "tokens", *sorted(host_names))
        """The dimensions its staged part depends on (the host pass's shapes' names)."""
        self._staged: dict[tuple, StagedPart] = {}

    def device_steps(self, done: frozenset) -> tuple[Step, ...]:
        """The steps the host pass left (``done``: what it computed)."""
        return self._device_steps[done]

    def batch_inputs(self, done: frozenset) -> frozenset[str]:
        """The batch tensors the steps left after the host pass read."""
        return self._inputs[done]

    def _live_pass(self) -> HostPass | None:
        """The host pass, unless one of its twins failed (it is then retired for good)."""
        host_pass = self.host_pass
        return None if host_pass is None or host_pass.failed else host_pass

    def stage(
        self,
        batch: ForwardBatch,
        reqs: int,
        dims: Mapping[str, int],
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool,
    ) -> tuple[Tensors, frozenset]:
        """Stage (the host pass running between the fill and the copy) and lay out; the
        tensors, and the outputs already computed. A host twin that fails is retired for
        good and the plan redone on the device."""
        host_pass = self._live_pass()
        layout = self._layout(dims, reqs, host_pass)
        tokens = dims["tokens"]
        work = None
        if host_pass is not None:

            def work(view):
                host_pass.run(view, layout.host, reqs, tokens)

        try:
            (staged,) = self.stager.stage(
                [batch],
                reqs,
                tokens,
                ranges,
                read_device=read_device,
                read_table=read_table,
                extra=layout.extra,
                host_work=work,
                device_extra=layout.device_extra,
            )
        except HostPassFailed:
            return self.stage(
                batch, reqs, dims, ranges, read_device=read_device, read_table=read_table
            )
        done = frozenset() if host_pass is None else host_pass.outputs
        return layout.views(staged, self.program.aliases), done

    def _layout(
        self, dims: Mapping[str, int], reqs: int, host_pass: HostPass | None
    ) -> FreshLayout:
        on = host_pass is not None
        try:
            key = (on, reqs, self._key(dims))
            staged_key = (on, reqs, self._staged_key(dims))
        except KeyError:  # a shape names a dimension not given: resolve_shape names the field
            return self._lay_out(dims, self._stage_part(dims, reqs, host_pass), host_pass)
        layout = self._layouts.get(key)
        if layout is None:
            part = self._staged.get(staged_key)
            if part is None:
                part = _kept(self._staged, staged_key, self._stage_part(dims, reqs, host_pass))
            layout = _kept(self._layouts, key, self._lay_out(dims, part, host_pass))
        return layout

    def _stage_part(
        self, dims: Mapping[str, int], reqs: int, host_pass: HostPass | None
    ) -> StagedPart:
        tokens, base = dims["tokens"], self.stager.size
        pieces: list[Piece] = [
            (key, seg.offset, (tokens if seg.per_token else reqs,))
            for key, seg in self.segments.items()
        ]
        host: tuple[Placement, ...] = ()
        sent = base
        if host_pass is not None:
            host, sent = host_pass.placements(base, dims)
            pieces += [(p.key, p.offset, p.shape) for p in host]
        return StagedPart(host, sent, Cuts().then(pieces, None))

    def _lay_out(
        self, dims: Mapping[str, int], part: StagedPart, host_pass: HostPass | None
    ) -> FreshLayout:
        done = frozenset() if host_pass is None else host_pass.outputs
        totals: dict[torch.dtype, int] = {torch.int32: part.sent}
        by_dtype: dict[torch.dtype, list[Piece]] = {torch.int32: []}
        for key, spec in _outputs(self.device_steps(done)):
            dtype = spec.dtype
            align = max(1, _ALIGN_BYTES // dtype.itemsize)
            start = -(-totals.get(dtype, 0) // align) * align
            shape = resolve_shape(spec.shape, dims, field=f"{key[0]}.{key[1]}")
            by_dtype.setdefault(dtype, []).append((key, start, shape))
            totals[dtype] = start + math.prod(shape)
        int32_total = totals.pop(torch.int32)
        arenas = tuple(
            (dtype, total, Cuts().then(by_dtype[dtype], total)) for dtype, total in totals.items()
        )
        base = self.stager.size
        return FreshLayout(
            part.host,
            part.sent - base,
            int32_total - part.sent,
            part.cuts.then(by_dtype[torch.int32], int32_total),
            arenas,
        )


def _outputs(steps: Iterable[Step]) -> Iterator[tuple[Key, TensorSpec]]:
    """Every field the steps fill (an op with named outputs fills several), with its spec."""
    for step in steps:
        yield from zip(step.outputs, step.specs)


def _kept(cache: dict, key: tuple, value):
    """``value`` kept under ``key``; the cache is emptied when full (ragged batches vary in
    shape, so it is bounded)."""
    if len(cache) >= _LAYOUTS_KEPT:
        cache.clear()
    cache[key] = value
    return value


class StaticStorage(_Storage):
    """Capture and replay: max-size buffers for one mode, and views of them per captured size
    (a ragged mode's per (size, token bucket)).

    The views of a size are made once and handed out again on every replay: the plans a
    graph was captured with hold exactly these tensors. Each field's view is the leading
    part of its flat buffer, so a batch dimension anywhere in the shape (``(2, "tokens")``)
    still gives a contiguous view. A bucket whose derived dimension exceeds what the
    buffers were sized for gets a larger buffer for that field (earlier buckets keep theirs).
    """

    static = True

    def __init__(
        self,
        program: Program,
        segments: Mapping[Key, Segment],
        stager: Stager,
        *,
        max_dims: Mapping[str, int],
    ) -> None:
        super().__init__(program, segments, stager)
        self.buffers = {
            key: torch.zeros(
                math.prod(resolve_shape(spec.shape, max_dims, field=f"{key[0]}.{key[1]}")),
                dtype=spec.dtype,
                device=stager.device,
            )
            for key, spec in _outputs(program.steps)
        }
        self._grown: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], Tensors] = {}

    def tensors(self, staged: torch.Tensor, reqs: int, dims: Mapping[str, int]) -> Tensors:
        """The plan tensors of a batch padded to ``reqs`` requests and ``dims["tokens"]``
        tokens: views of the staged region and of the buffers, made once per bucket."""
        tokens = dims["tokens"]
        views = self._views.get((reqs, tokens))
        if views is None:
            segments = source_segments(self.program, self.stager.layout_for(reqs, tokens))
            views = {
                key: staged[seg.offset : seg.offset + (tokens if seg.per_token else reqs)]
                for key, seg in segments.items()
            }
            for key, spec in _outputs(self.program.steps):
                shape = resolve_shape(spec.shape, dims, field=f"{key[0]}.{key[1]}")
                size, flat = math.prod(shape), self.buffers[key]
                if size > flat.numel():
                    flat = self.buffers[key] = torch.zeros(
                        size, dtype=spec.dtype, device=flat.device
                    )
                    self._grown.append(flat)
                views[key] = flat[:size].view(shape)
            for alias, owner in self.program.aliases.items():
                views[alias] = views[owner]
            self._views[(reqs, tokens)] = views
        return views

    @property
    def nbytes(self) -> int:
        """Bytes of the plan buffers (the stager, maybe shared by steps, is counted apart)."""
        held = {id(t): t for t in (*self.buffers.values(), *self._grown)}
        return sum(t.numel() * t.element_size() for t in held.values())


Storage = FreshStorage | StaticStorage


class Storages:
    """One planner's staging layouts, storages and input ranges, made on first use."""

    def __init__(
        self,
        programs: Mapping[ForwardMode, Program],
        limits: Limits,
        device: torch.device,
        *,
        eager_on_host: bool = True,
        transport: TransportFactory | None = None,
    ) -> None:
        self.programs = programs
        self.limits = limits
        self.device = device
        self.eager_on_host = eager_on_host
        self.copies = CopyTransport(device)
        """The copy every eager plan stages through (and captures, unless ``transport``)."""
        self.transport = transport
        self._switch = Switch()
        self._layouts: dict[tuple[ForwardMode, int], StagingLayout] = {}
        self._fresh: dict[tuple[ForwardMode, int], FreshStorage] = {}
        self._static: dict[ForwardMode, list[StaticStorage]] = {}
        self._ranges: dict[tuple, Ranges] = {}
        self._max_dims: dict[ForwardMode, dict[str, int]] = {}

    def token_capacity(self, mode: ForwardMode, reqs: int) -> int:
        """Query tokens a batch of ``reqs`` requests may hold in ``mode``: the staging capacity."""
        if mode.ragged:
            return self.limits.extend_tokens
        return reqs * self.programs[mode].next_n

    def kv_tokens(self, mode: ForwardMode, reqs: int) -> int:
        """Flat KV entries of a static batch of ``reqs`` requests: ``reqs * max_context``; for a
        ragged mode at most :attr:`Limits.kv_token_capacity` (the stated bound), plus room
        for the padding requests' KV (``seq_lens``' pad each)."""
        full = reqs * self.limits.max_context
        if not mode.ragged:
            return full
        program = self.programs[mode]
        pad = max(  # what each padding request's KV length is: on top of the bound
            (
                int(program.pads[(backend, name)] or 0)
                for backend, cls in program.schemas.items()
                for name, spec in cls.tensor_specs.items()
                if spec.source == "seq_lens"
            ),
            default=0,
        )
        return min(full, self.limits.kv_token_capacity) + reqs * pad

    def layout(self, mode: ForwardMode, reqs: int) -> StagingLayout:
        """Sized by request count, not by tokens: a ragged batch's layout holds the token
        capacity, so layouts stay few however the extend lengths vary."""
        key = (mode, reqs)
        layout = self._layouts.get(key)
        if layout is None:
            program = self.programs[mode]
            sources = [
                (spec.source, program.pads[(backend, name)])
                for backend, cls in program.schemas.items()
                for name, spec in cls.tensor_specs.items()
                if spec.source is not None
            ]
            layout = StagingLayout(sources, reqs, self.token_capacity(mode, reqs))
            self._layouts[key] = layout
        return layout

    def ranges(self, mode: ForwardMode, table: torch.Tensor) -> Ranges:
        key = (mode, table.shape[0], table.shape[1])
        ranges = self._ranges.get(key)
        if ranges is None:
            limits = self.limits
            ranges = self._ranges[key] = input_ranges(
                limits.max_context,
                self.programs[mode].next_n,
                limits.kv_slots,
                table,
                ragged=mode.ragged,
                partial=mode.padded_rows,
            )
        return ranges

    def fresh(self, mode: ForwardMode, reqs: int) -> FreshStorage:
        key = (mode, reqs)
        storage = self._fresh.get(key)
        if storage is None:
            program, layout = self.programs[mode], self.layout(mode, reqs)
            segments = source_segments(program, layout)
            stager = Stager(layout, self.device, self.copies, static=False)
            host_pass = (
                host_pass_for(program, segments, self._switch) if self.eager_on_host else None
            )
            storage = self._fresh[key] = FreshStorage(
                program, segments, stager, host_pass=host_pass
            )
        return storage

    def static(self, mode: ForwardMode, steps: int = 1) -> list[StaticStorage]:
        """Capture and replay buffers of ``mode``: one storage per step (a stepped mode's
        ``steps``), all staged through one stager, so one transfer moves every step's inputs."""
        storages = self._static.get(mode)
        if storages is None:
            if mode.ragged and self.limits.ragged_kv_tokens is None:
                self.check_budget({mode})  # counted from the first capture: see static_estimate
            limits, program = self.limits, self.programs[mode]
            layout = self.layout(mode, limits.max_batch)
            segments = source_segments(program, layout)
            words = max(layout.size, 1) * steps
            transport = (
                self.copies
                if self.transport is None
                else self.transport(words, self.device, mode.value)
            )
            stager = Stager(layout, self.device, transport, static=True, regions=steps)
            max_dims = self.max_dims(mode)
            storages = self._static[mode] = [
                StaticStorage(program, segments, stager, max_dims=max_dims) for _ in range(steps)
            ]
        return storages

    def max_dims(self, mode: ForwardMode) -> dict[str, int]:
        """The dimensions static buffers are sized for: the largest batch's, and for a
        backend's derived dimensions the largest value over every batch size (a split
        count shrinks as the batch grows), a ragged mode's at its token capacity (a token
        bucket needing more grows the field: ``StaticStorage.tensors``). Worked out once per
        mode: the budget check at build and the first capture both need it."""
        known = self._max_dims.get(mode)
        if known is not None:
            return known
        limits, program = self.limits, self.programs[mode]
        sizes = [
            batch_dims(
                program,
                limits.page_size,
                limits.num_sms,
                reqs=reqs,
                max_len=limits.max_context,
                tokens=self.token_capacity(mode, reqs),
                kv_tokens=self.kv_tokens(mode, reqs),
            )
            for reqs in range(1, limits.max_batch + 1)
        ]
        known = self._max_dims[mode] = {name: max(d[name] for d in sizes) for name in sizes[-1]}
        return known

    def static_estimate(
        self, include: frozenset[ForwardMode] | set[ForwardMode] = frozenset()
    ) -> dict[tuple[ForwardMode, str], int]:
        """Bytes each static buffer will take, before any is made, in the modes a graph runner
        captures: decode, target-verify when ``next_n`` > 1, and a ragged mode (extend,
        mixed) once it is captured, in ``include``, or from the start when
        ``Limits.ragged_kv_tokens`` is set (unset, ragged buffers would count
        ``max_batch * max_context`` KV entries against a planner that may never capture one).
        Each op field at the limits' largest shape, the staging buffer, and the host buffer it
        is filled in (``"staging (host)"``, pinned on CUDA; not counted by :meth:`nbytes`). A
        stepped mode (draft decode) keeps every buffer once per step."""
        out: dict[tuple[ForwardMode, str], int] = {}
        counted = set(include) | set(self._static)
        for mode, program in self.programs.items():
            if mode.ragged and mode not in counted and self.limits.ragged_kv_tokens is None:
                continue
            if mode is ForwardMode.TARGET_VERIFY and self.limits.next_n == 1:
                continue
            steps = self.limits.draft_steps if mode.stepped else 1
            dims = self.max_dims(mode)
            for (backend, name), spec in _outputs(program.steps):
                key = f"{backend}.{name}"
                shape = resolve_shape(spec.shape, dims, field=key)
                out[(mode, key)] = math.prod(shape) * spec.dtype.itemsize * steps
            staging = max(self.layout(mode, self.limits.max_batch).size, 1) * 4 * steps
            out[(mode, "staging")] = staging
            out[(mode, "staging (host)")] = staging
        return out

    def check_budget(
        self, include: frozenset[ForwardMode] | set[ForwardMode] = frozenset()
    ) -> None:
        """Refuse limits whose static buffers would exceed ``Limits.max_static_bytes``, naming
        the field that takes the most, before anything is allocated (``include``: ragged
        modes about to be captured, see :meth:`static_estimate`)."""
        estimate = self.static_estimate(include)
        total, budget = sum(estimate.values()), self.limits.max_static_bytes
        if total <= budget:
            return
        (mode, key), most = max(estimate.items(), key=lambda item: item[1])
        raise ConfigError(
            f"static plan buffers would take {_gib(total)}, over Limits.max_static_bytes "
            f"({_gib(budget)}); the largest is {key} in {mode.value} ({_gib(most)}), sized by "
            f"max_batch {self.limits.max_batch} and max_context {self.limits.max_context}"
            f"{' (ragged: max_tokens, ragged_kv_tokens)' if mode.ragged else ''}: "
            "lower them, or raise max_static_bytes",
            field=key,
            expected=f"<= {budget} bytes",
            actual=f"{total} bytes",
        )

    def nbytes(self) -> int:
        """Bytes held in static buffers (plans and staging) for every captured mode."""
        total = 0
        for storages in self._static.values():
            total += sum(storage.nbytes for storage in storages)
            buf = storages[0].stager.device_buf
            total += buf.numel() * buf.element_size()
        return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
