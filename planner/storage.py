"""Where plan tensors live: each eager plan's own memory, or the static buffers a graph reads.

The phases differ only here and in which steps they run. An eager plan owns its tensors
(:class:`FreshStorage`): no later plan writes memory that any of them can still read, so each
batch gets a new device buffer holding its raw inputs, its error word and its int32 fields
(one allocation), and one allocation per other dtype. Captured plans are views of max-size
buffers a CUDA graph reads (:class:`StaticStorage`), made once per bucket and handed out
again on every replay; their raw inputs come through the mode's :class:`Stager`.

Either way the source fields (a schema's ``source=``) are written by the device check
(``planner.device_checks``) from the raw inputs, and every other field by its op.

:class:`Storages` keeps a planner's stagers, storages and checks, sized from its limits, and
refuses limits whose static buffers would not fit their budget before any is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import torch

from planner.batch import ForwardBatch, ForwardMode
from planner.device_checks import ERROR_WORDS, Bounds, InputCheck
from planner.errors import ConfigError, SchemaError
from planner.limits import Limits
from planner.program import Key, Program, Step, batch_dims
from planner.schema import TensorSpec, resolve_shape
from planner.staging import CopyTransport, Stager, TransportFactory, input_bounds
from planner.step_inputs import InputLayout, StepInputs, copy_on_device, write_batch

Tensors = dict[Key, torch.Tensor]
SourceKey = tuple[str, int]
"""``(source, pad)``: one source field the device check writes (fields alike share it)."""
_ALIGN_BYTES = 256
"""Fields start on 256-byte boundaries, the alignment a separate allocation gives kernels."""


def source_fields(program: Program) -> dict[SourceKey, Key]:
    """The field that holds each ``(source, pad)`` the schemas read (the first; the others
    are its aliases, ``Program.aliases``)."""
    out: dict[SourceKey, Key] = {}
    for backend, cls in program.schemas.items():
        for name, spec in cls.tensor_specs.items():
            if spec.source is not None:
                pad = program.pads[(backend, name)]
                if not isinstance(pad, int):
                    raise SchemaError(
                        "a source field pads with an integer (the device check writes it)",
                        field=f"{backend}.{name}",
                        expected="an int or an integer Setting",
                        actual=pad,
                    )
                out.setdefault((spec.source, pad), (backend, name))
    return out


def same_sources(program: Program) -> dict[Key, Key]:
    """Every source field other than its ``(source, pad)``'s owner, to the owner: one
    tensor, as aliases are."""
    owners = source_fields(program)
    return {
        (backend, name): owners[(spec.source, program.pads[(backend, name)])]
        for backend, cls in program.schemas.items()
        for name, spec in cls.tensor_specs.items()
        if spec.source is not None
        and owners[(spec.source, program.pads[(backend, name)])] != (backend, name)
    }


def _source_spec(program: Program, key: Key) -> TensorSpec:
    return program.schemas[key[0]].tensor_specs[key[1]]


def _outputs(steps: Iterable[Step]) -> Iterator[tuple[Key, TensorSpec]]:
    """Every field the steps fill (an op with named outputs fills several), with its spec."""
    for step in steps:
        yield from zip(step.outputs, step.specs)


def _fields(program: Program) -> Iterator[tuple[Key, TensorSpec]]:
    """Every field a storage makes: the source fields, then the op fields."""
    for key in source_fields(program).values():
        yield key, _source_spec(program, key)
    yield from _outputs(program.steps)


class FreshStorage:
    """Eager plans of one mode: see the module docstring."""

    static = False

    def __init__(self, program: Program, layout: InputLayout, device: torch.device) -> None:
        self.program, self.layout, self.device = program, layout, device
        self.sources = source_fields(program)
        self.aliases = {**same_sources(program), **program.aliases}

    def stage(
        self, batch: ForwardBatch, tokens: int, dims: Mapping[str, int]
    ) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
        """A new plan's memory with ``batch`` written into its raw inputs (``tokens`` real
        query tokens): its tensors, its raw region and its error word."""
        layout, device = self.layout, self.device
        per_dtype: dict[torch.dtype, list[tuple[Key, int, tuple[int, ...]]]] = {}
        totals: dict[torch.dtype, int] = {torch.int32: layout.size + ERROR_WORDS}
        for key, spec in _fields(self.program):
            align = max(1, _ALIGN_BYTES // spec.dtype.itemsize)
            start = -(-totals.get(spec.dtype, 0) // align) * align
            shape = resolve_shape(spec.shape, dims, field=f"{key[0]}.{key[1]}")
            per_dtype.setdefault(spec.dtype, []).append((key, start, shape))
            totals[spec.dtype] = start + math.prod(shape)
        arenas = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in totals.items()}
        int32 = arenas[torch.int32]
        region = int32[: layout.size]
        error = int32[layout.size : layout.size + ERROR_WORDS]
        error.zero_()
        if device.type == "cpu":
            pending = write_batch(StepInputs(region, layout), batch, tokens)
        else:
            host = torch.empty(layout.size, dtype=torch.int32, pin_memory=True)
            pending = write_batch(StepInputs(host, layout), batch, tokens)
            region.copy_(host, non_blocking=True)
        copy_on_device(region, layout, dict(pending))
        tensors: Tensors = {}
        for dtype, pieces in per_dtype.items():
            arena = arenas[dtype]
            for key, start, shape in pieces:
                tensors[key] = arena[start : start + math.prod(shape)].view(shape)
        for alias, owner in self.aliases.items():
            tensors[alias] = tensors[owner]
        return tensors, region, error

    def outputs(self, tensors: Tensors) -> dict[SourceKey, torch.Tensor]:
        """The source fields the device check writes, by ``(source, pad)``."""
        return {source: tensors[key] for source, key in self.sources.items()}


class StaticStorage:
    """Capture and replay: max-size buffers for one mode (one storage per step of a stepped
    mode), and views of them per captured bucket.

    The views of a bucket are made once and handed out again on every replay: the plans a
    graph was captured with hold exactly these tensors. Each field's view is the leading
    part of its flat buffer, so a batch dimension anywhere in the shape (``(2, "tokens")``)
    still gives a contiguous view. A bucket whose derived dimension exceeds what the
    buffers were sized for gets a larger buffer for that field (earlier buckets keep theirs).
    """

    static = True

    def __init__(
        self, program: Program, stager: Stager, region: int, *, max_dims: Mapping[str, int]
    ) -> None:
        self.program, self.stager, self.region = program, stager, region
        self.sources = source_fields(program)
        self.aliases = {**same_sources(program), **program.aliases}
        self.buffers = {
            key: torch.zeros(
                math.prod(resolve_shape(spec.shape, max_dims, field=f"{key[0]}.{key[1]}")),
                dtype=spec.dtype,
                device=stager.device_buf.device,
            )
            for key, spec in _fields(program)
        }
        self._grown: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], Tensors] = {}

    @property
    def raw(self) -> torch.Tensor:
        """This storage's region of the stager's device buffer: the raw inputs."""
        return self.stager.device_regions[self.region]

    def tensors(self, reqs: int, dims: Mapping[str, int]) -> Tensors:
        """The plan tensors of a batch padded to ``reqs`` requests and ``dims["tokens"]``
        tokens: views of the buffers, made once per bucket."""
        bucket = (reqs, dims["tokens"])
        views = self._views.get(bucket)
        if views is None:
            views = {}
            for key, spec in _fields(self.program):
                shape = resolve_shape(spec.shape, dims, field=f"{key[0]}.{key[1]}")
                size, flat = math.prod(shape), self.buffers[key]
                if size > flat.numel():
                    flat = self.buffers[key] = torch.zeros(
                        size, dtype=spec.dtype, device=flat.device
                    )
                    self._grown.append(flat)
                views[key] = flat[:size].view(shape)
            for alias, owner in self.aliases.items():
                views[alias] = views[owner]
            self._views[bucket] = views
        return views

    def outputs(self, tensors: Tensors) -> dict[SourceKey, torch.Tensor]:
        return {source: tensors[key] for source, key in self.sources.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the plan buffers (the stager, shared by steps, is counted apart)."""
        held = {id(t): t for t in (*self.buffers.values(), *self._grown)}
        return sum(t.numel() * t.element_size() for t in held.values())


Storage = FreshStorage | StaticStorage


class Storages:
    """One planner's stagers, storages and device checks, made on first use."""

    def __init__(
        self,
        programs: Mapping[ForwardMode, Program],
        limits: Limits,
        device: torch.device,
        *,
        transport: TransportFactory | None = None,
    ) -> None:
        self.programs = programs
        self.limits = limits
        self.device = device
        self.transport = transport
        self._fresh: dict[ForwardMode, FreshStorage] = {}
        self._static: dict[ForwardMode, list[StaticStorage]] = {}
        self._checks: dict[tuple, InputCheck] = {}
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
        pad = max(
            (pad for source, pad in source_fields(self.programs[mode]) if source == "seq_lens"),
            default=0,
        )
        return min(full, self.limits.kv_token_capacity) + reqs * pad

    def layout(self, mode: ForwardMode) -> InputLayout:
        """The raw inputs' layout of ``mode``: its capacity, the same in every phase."""
        reqs = self.limits.max_batch
        return InputLayout(reqs, self.token_capacity(mode, reqs))

    def bounds(self, mode: ForwardMode, table: torch.Tensor, *, static: bool) -> Bounds:
        limits = self.limits
        kv_bound = limits.kv_token_capacity if static and mode.ragged else None
        return input_bounds(
            mode, limits.max_context, self.programs[mode].next_n, limits.kv_slots, table, kv_bound
        )

    def check(self, mode: ForwardMode, table: torch.Tensor, *, static: bool) -> InputCheck:
        """The device check of ``mode``'s batches over a token table of ``table``'s shape."""
        key = (mode, tuple(table.shape), static)
        check = self._checks.get(key)
        if check is None:
            bounds = self.bounds(mode, table, static=static)
            ident = len(self._checks)
            check = InputCheck(self.layout(mode), bounds, self.device, ident, per_bucket=static)
            self._checks[key] = check
        return check

    def check_by_id(self, ident: int) -> InputCheck:
        """The check whose error word names ``ident``."""
        return next(check for check in self._checks.values() if check.ident == ident)

    def captured(self, mode: ForwardMode) -> list[StaticStorage] | None:
        """The static storages of ``mode``, if it was captured."""
        return self._static.get(mode)

    def captured_modes(self) -> list[ForwardMode]:
        return list(self._static)

    def fresh(self, mode: ForwardMode) -> FreshStorage:
        storage = self._fresh.get(mode)
        if storage is None:
            storage = self._fresh[mode] = FreshStorage(
                self.programs[mode], self.layout(mode), self.device
            )
        return storage

    def static(self, mode: ForwardMode, steps: int = 1) -> list[StaticStorage]:
        """Capture and replay buffers of ``mode``: one storage per step (a stepped mode's
        ``steps``), all staged through one stager, so one transfer moves every step's inputs."""
        storages = self._static.get(mode)
        if storages is None:
            if mode.ragged and self.limits.ragged_kv_tokens is None:
                self.check_budget({mode})  # counted from the first capture: see static_estimate
            layout = self.layout(mode)
            words = layout.size * steps
            transport = (
                CopyTransport(words, self.device)
                if self.transport is None
                else self.transport(words, self.device, mode.value)
            )
            stager = Stager(layout, self.device, transport, mode, regions=steps)
            max_dims = self.max_dims(mode)
            storages = self._static[mode] = [
                StaticStorage(self.programs[mode], stager, r, max_dims=max_dims)
                for r in range(steps)
            ]
        return storages

    def max_dims(self, mode: ForwardMode) -> dict[str, int]:
        """The dimensions static buffers are sized for: the largest batch's, and for a
        backend's derived dimensions the largest value over every batch size (a split
        count shrinks as the batch grows), a ragged mode's at its token capacity (a token
        bucket needing more grows the field: ``StaticStorage.tensors``)."""
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
        Each field at the limits' largest shape, the raw inputs' device buffer, and the host
        slots they are written in (``"staging (host)"``, pinned on CUDA; not counted by
        :meth:`nbytes`). A stepped mode (draft decode) keeps every buffer once per step."""
        out: dict[tuple[ForwardMode, str], int] = {}
        counted = set(include) | set(self._static)
        for mode, program in self.programs.items():
            if mode.ragged and mode not in counted and self.limits.ragged_kv_tokens is None:
                continue
            if mode is ForwardMode.TARGET_VERIFY and self.limits.next_n == 1:
                continue
            steps = self.limits.draft_steps if mode.stepped else 1
            dims = self.max_dims(mode)
            for (backend, name), spec in _fields(program):
                key = f"{backend}.{name}"
                shape = resolve_shape(spec.shape, dims, field=key)
                out[(mode, key)] = math.prod(shape) * spec.dtype.itemsize * steps
            staging = self.layout(mode).size * 4 * steps
            out[(mode, "staging")] = staging
            out[(mode, "staging (host)")] = staging * CopyTransport.SLOTS
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
        """Bytes held in static buffers (plans and raw inputs) for every captured mode."""
        total = 0
        for storages in self._static.values():
            total += sum(storage.nbytes for storage in storages)
            buf = storages[0].stager.device_buf
            total += buf.numel() * buf.element_size()
        return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
