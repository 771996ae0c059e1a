"""The planner: every backend's metadata, computed once per batch, in three phases.

- ``plan(batch)``: eager. Fresh tensors, full validation, frozen plans.
- ``capture(bs)``: plans whose tensors are views of static max-size
  buffers, filled from a valid dummy batch; ``record(bs)`` then runs the
  graph-safe ops inside the caller's CUDA graph, once, before the layers.
- ``replay(batch)``: stage raw inputs (one pinned buffer, one copy), run host
  ops, and hand back the very plan objects of the capture.

Layers receive a :class:`PlanSet` and only read it. Whatever the number of
layers, each op runs once per batch; ``stats`` counts it.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.batch import ForwardBatch, ForwardMode, validate_batch
from planner.dims import resolve_shape
from planner.errors import (
    BatchError,
    ConfigError,
    PlanError,
    PlanWriteError,
    ProviderError,
    ReplayError,
    SchemaError,
)
from planner.limits import Limits
from planner.ops import get_op, warn_once
from planner.program import Program, Step, build_program
from planner.registry import get_backend
from planner.schema import Plan, Setting
from planner.staging import Segment, StagingLayout, StaticStager, stage_fresh
from planner.verify import diff_plans, padding_violations, plan_digests

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}


def debug_from_env() -> bool:
    """``PLANNER_DEBUG``: a misspelt value must not silently leave the checks off."""
    value = os.environ.get("PLANNER_DEBUG", "").strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ConfigError(
        "not a boolean",
        field="PLANNER_DEBUG",
        expected="1/true/yes/on or 0/false/no/off",
        actual=value,
    )


def known_options(plan_cls: type[Plan]) -> set[str]:
    """Settings a backend reads: its defaults and every Setting its fields name."""
    names = set(getattr(plan_cls, "defaults", {}))
    for spec in plan_cls.tensor_specs.values():
        for value in (*spec.params.values(), spec.pad):
            if isinstance(value, Setting):
                names.add(value.name)
    names |= {spec.value for spec in plan_cls.scalar_specs.values()}
    return names


class _ProviderFailed(Exception):
    """Internal: a provider was retired mid-call; the public call starts over."""


class PlanSet(Mapping[str, Plan]):
    """The frozen plans of one batch, by backend name, with how they were made."""

    __slots__ = ("_plans", "phase", "mode", "reqs", "real_reqs")

    def __init__(
        self, plans: dict[str, Plan], phase: str, mode: ForwardMode, reqs: int, real_reqs: int
    ):
        self._plans = plans
        self.phase = phase
        self.mode = mode
        self.reqs = reqs
        self.real_reqs = real_reqs

    def __getitem__(self, backend: str) -> Plan:
        try:
            return self._plans[backend]
        except KeyError:
            raise SchemaError(
                "no plan for backend", field=backend, expected=sorted(self._plans)
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        return f"PlanSet({self.phase}, {self.mode.value}, reqs={self.reqs}/{self.real_reqs}, {sorted(self._plans)})"


@dataclass
class PlannerStats:
    """What the planner did: batches per phase, op executions, host time.

    The hot path only counts how often each program ran (one increment per
    batch); per-op and per-field counts are derived when read.
    """

    batches: Counter = field(default_factory=Counter)
    host_seconds: Counter = field(default_factory=Counter)
    verified: int = 0
    program_runs: Counter = field(default_factory=Counter)
    programs: dict = field(default_factory=dict)

    def record_steps(self, mode: ForwardMode, steps: Sequence[Step]) -> None:
        self.program_runs[mode] += 1
        self.programs[mode] = steps

    @property
    def op_calls(self) -> Counter:
        """Executions per op name (a field's op counts once per batch, whatever the layers)."""
        out: Counter = Counter()
        for mode, runs in self.program_runs.items():
            for step in self.programs[mode]:
                out[step.op_name] += runs
        return out

    @property
    def field_calls(self) -> Counter:
        """Executions per ``backend.field``."""
        out: Counter = Counter()
        for mode, runs in self.program_runs.items():
            for step in self.programs[mode]:
                out[step.key] += runs
        return out

    def reset(self) -> None:
        self.__init__()


@dataclass
class _Capture:
    plans: PlanSet
    views: dict[tuple[str, str], torch.Tensor]
    pointers: list[tuple[str, int]]
    tensors: list[torch.Tensor]
    table_ptr: int
    table_shape: tuple[int, ...]
    dummy: ForwardBatch


@dataclass
class _Static:
    stager: StaticStager
    buffers: dict[tuple[str, str], torch.Tensor]
    segments: dict[tuple[str, str], Segment]


class Planner:
    """Plans every backend's metadata for each batch; see the module docstring."""

    def __init__(
        self,
        backends: Sequence[str | type[Plan]],
        limits: Limits,
        *,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        providers: Mapping[str, str] | None = None,
        debug: bool | None = None,
        ops_in_graph: bool = True,
    ) -> None:
        if not backends:
            raise SchemaError("a planner needs at least one backend", field="backends")
        self.limits = limits
        self.device = limits.torch_device
        self.schemas: dict[str, type[Plan]] = {}
        for item in backends:
            cls = get_backend(item) if isinstance(item, str) else item
            self.schemas[cls.backend] = cls
        unknown = set(options or {}) - set(self.schemas)
        if unknown:
            raise SchemaError(
                "options for backends not planned",
                field="options",
                expected=sorted(self.schemas),
                actual=sorted(unknown),
            )
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        for backend, given in self.options.items():
            known = known_options(self.schemas[backend])
            unknown = sorted(set(given) - known)
            if unknown:
                raise SchemaError(
                    "unknown backend option",
                    field=f"{backend}.{unknown[0]}",
                    expected=sorted(known),
                    actual=unknown,
                )
        self.forced = dict(providers or {})
        self.debug = debug_from_env() if debug is None else debug
        self.ops_in_graph = ops_in_graph
        self.stats = PlannerStats()
        self.on_mismatch = None  # set by dumps: called with (batch, replayed, eager) before raising
        self._base = {
            "max_batch": limits.max_batch,
            "max_context": limits.max_context,
            "page_size": limits.page_size,
            "next_n": limits.next_n,
            "num_sms": limits.num_sms,
        }
        self._programs: dict[ForwardMode, Program] = {}
        self._failed_providers: dict[str, set[str]] = {}
        self._fallbacks: dict[str, str] = {}
        self._source_cache: dict[ForwardMode, list] = {}
        self._eager_layouts: dict[tuple[ForwardMode, int], StagingLayout] = {}
        self._limit_cache: dict[tuple, dict[str, tuple[int, int]]] = {}
        self._static: dict[ForwardMode, _Static] = {}
        self._captured: dict[tuple[ForwardMode, int], _Capture] = {}
        for mode in ForwardMode:
            self.program(mode)  # surface schema errors at construction
        self._stages_lengths = any(
            s == "seq_lens" for _, s, _, _ in self._sources(ForwardMode.DECODE)
        )
        self._check_forced_keys()

    # ---- building -------------------------------------------------------------------------

    def program(self, mode: ForwardMode) -> Program:
        """The ordered steps for ``mode`` (built once)."""
        if mode not in self._programs:
            self._programs[mode] = build_program(
                self.schemas,
                self._base,
                self.options,
                {**self._fallbacks, **self.forced},
                self.device,
                mode,
                self.ops_in_graph,
            )
        return self._programs[mode]

    def _check_forced_keys(self) -> None:
        known = set()
        for step in self.program(ForwardMode.DECODE).steps:
            known |= {step.key, step.op_name}
        unknown = set(self.forced) - known
        if unknown:
            raise SchemaError(
                "provider override for an op no planned field uses",
                field="providers",
                expected=sorted(known),
                actual=sorted(unknown),
            )

    def providers_chosen(self, mode: ForwardMode = ForwardMode.DECODE) -> dict[str, str]:
        """``backend.field`` -> provider name, for reports."""
        return {s.key: s.provider.name for s in self.program(mode).steps}

    def dims(self, mode: ForwardMode, reqs: int, max_len: int) -> dict[str, int]:
        """Values of the symbolic dimensions for a batch of ``reqs`` requests."""
        program = self.program(mode)
        dims = {
            k: v
            for k, v in program.settings.items()
            if isinstance(v, int) and not isinstance(v, bool)
        }
        dims.update(
            reqs=reqs,
            rows=reqs * program.next_n,
            max_len=max_len,
            pages=-(-max_len // self.limits.page_size),
            req_pages=reqs * -(-max_len // self.limits.page_size),
            sms=self.limits.num_sms,
            next_n=program.next_n,
        )
        return dims

    def _sources(self, mode: ForwardMode) -> list[tuple[tuple[str, str], str, bool, int]]:
        """Source fields of every schema: (key, source, per token, pad); built once per mode."""
        cached = self._source_cache.get(mode)
        if cached is not None:
            return cached
        program = self.program(mode)
        out = []
        for backend, cls in self.schemas.items():
            for name, spec in cls.tensor_specs.items():
                if spec.source is not None:
                    pad = program.pads[(backend, name)]
                    out.append(((backend, name), spec.source, spec.row_dim == "rows", int(pad)))
        self._source_cache[mode] = out
        return out

    def _eager_layout(self, mode: ForwardMode, reqs: int) -> StagingLayout:
        key = (mode, reqs)
        layout = self._eager_layouts.get(key)
        if layout is None:
            sources = [(s, t, p) for _, s, t, p in self._sources(mode)]
            layout = self._eager_layouts[key] = StagingLayout(
                sources, reqs, self.program(mode).next_n
            )
        return layout

    def _range_limits(self, mode: ForwardMode, table: torch.Tensor) -> dict[str, tuple[int, int]]:
        """Inclusive value limits of each staged input, for the vectorised door check."""
        key = (mode, table.shape[0], table.shape[1])
        limits = self._limit_cache.get(key)
        if limits is None:
            ctx = self.limits.max_context
            slots = self.limits.kv_slots
            limits = self._limit_cache[key] = {
                "seq_lens": (self.program(mode).next_n, min(ctx, table.shape[1])),
                "req_pool_indices": (0, table.shape[0] - 1),
                "out_cache_loc": (0, (slots if slots is not None else 2**31) - 1),
                "positions": (0, ctx - 1),
                "_max_context": (0, ctx),
            }
        return limits

    def _build_plans(
        self,
        mode: ForwardMode,
        tensors: dict[tuple[str, str], torch.Tensor],
        dims: Mapping[str, int],
    ) -> dict[str, Plan]:
        program = self.program(mode)
        plans = {}
        for backend, cls in self.schemas.items():
            values: dict[str, Any] = {name: tensors[(backend, name)] for name in cls.tensor_specs}
            for name, spec in cls.scalar_specs.items():
                if spec.value in dims:
                    values[name] = dims[spec.value]
                elif spec.value in program.backend_settings[backend]:
                    # this backend's own value: two backends may define one setting differently
                    values[name] = program.backend_settings[backend][spec.value]
                else:
                    raise SchemaError(
                        f"scalar refers to unknown value {spec.value!r}", field=f"{backend}.{name}"
                    )
            plans[backend] = cls.model_construct(**values)
        return plans

    @staticmethod
    def _run(
        step: Step,
        tensors: dict[tuple[str, str], torch.Tensor],
        batch: ForwardBatch,
        *,
        static: bool = False,
    ) -> None:
        args = [
            tensors[key]
            if key[0]
            else batch.req_to_token
            if key[1] == "req_to_token"
            else batch.seq_lens_cpu
            for key in step.input_keys
        ]
        # Host ops learn whether their tensors are static views (capture/replay) or fresh
        # (eager): e.g. FlashInfer binds a CUDA-graph wrapper to the former only.
        params = step.params if step.provider.graph_safe else {**step.params, "static": static}
        step.provider.fn(tensors[(step.backend, step.field)], *args, **params)

    # ---- run-time provider fallback ---------------------------------------------------------

    def _run_or_fall_back(
        self, step: Step, tensors, batch: ForwardBatch, *, static: bool = False
    ) -> None:
        """Run a step; a provider that fails (a JIT error, a broken install) is replaced.

        The torch reference never is (its failure is a bug to surface), nor a
        provider the config forced (the user asked for exactly that one).
        """
        try:
            self._run(step, tensors, batch, static=static)
        except PlanError:
            raise
        except Exception as exc:
            name = step.provider.name
            if name == "torch":
                raise
            if self.forced.get(step.key) == name or self.forced.get(step.op_name) == name:
                raise ProviderError(
                    f"forced provider failed: {exc!r}", field=step.key, actual=name
                ) from exc
            op = get_op(step.op_name)
            failed = self._failed_providers.setdefault(step.op_name, set())
            failed.add(name)
            usable = [
                p
                for p in op.providers.values()
                if p.name not in failed
                and p.graph_safe == step.provider.graph_safe
                and p.is_available(self.device)
            ]
            replacement = min(usable, key=lambda p: (p.rank, p.name)).name
            warn_once(
                f"{step.op_name}: provider {name!r} failed ({type(exc).__name__}: {exc}); "
                f"using {replacement!r} from now on"
            )
            self._fallbacks[step.op_name] = replacement
            self._programs.clear()
            self._source_cache.clear()
            raise _ProviderFailed from exc

    def _retrying(self, fn, *args, **kwargs):
        for _ in range(8):  # each retry retires one provider; an op has a handful at most
            try:
                return fn(*args, **kwargs)
            except _ProviderFailed:
                continue
        return fn(*args, **kwargs)

    # ---- eager ----------------------------------------------------------------------------

    def plan(self, batch: ForwardBatch, *, pad_to: int | None = None) -> PlanSet:
        """Eager plans in fresh tensors.

        ``pad_to`` plans the batch padded to that many requests at the static
        shapes a captured plan has: what a replay of that size must equal.
        """
        return self._retrying(self._plan, batch, pad_to=pad_to, count=True)

    def _plan(self, batch: ForwardBatch, *, pad_to: int | None, count: bool) -> PlanSet:
        start = time.perf_counter()
        self._validate(batch, device_reads=True)
        mode = ForwardMode(batch.mode)
        program = self.program(mode)
        if pad_to is not None and not batch.bs <= pad_to <= self.limits.max_batch:
            raise BatchError(
                "pad_to out of range",
                field="pad_to",
                expected=f"[{batch.bs}, {self.limits.max_batch}]",
                actual=pad_to,
            )
        reqs = pad_to or batch.bs
        sources = self._sources(mode)
        layout = self._eager_layout(mode, reqs)
        limits = self._range_limits(mode, batch.req_to_token)
        staged, _ = stage_fresh(layout, batch, reqs, program.next_n, self.device, limits)
        max_len = self.limits.max_context if pad_to is not None else int(batch.seq_lens_cpu.max())
        dims = self.dims(mode, reqs, max_len)
        tensors: dict[tuple[str, str], torch.Tensor] = {}
        for key, source, per_token, pad in sources:
            seg = layout.segments[(source, pad)]
            n = dims["rows"] if per_token else reqs
            tensors[key] = staged[seg.offset : seg.offset + n]
        tensors.update(self._eager_outputs(program, dims))
        for step in program.steps:
            self._run_or_fall_back(step, tensors, batch)
        for alias, owner in program.aliases.items():
            tensors[alias] = tensors[owner]
        plans = PlanSet(self._build_plans(mode, tensors, dims), "eager", mode, reqs, batch.bs)
        if count:
            self.stats.record_steps(mode, program.steps)
            self.stats.batches["eager"] += 1
            self.stats.host_seconds["eager"] += time.perf_counter() - start
        return plans

    def _eager_outputs(
        self, program: Program, dims: Mapping[str, int]
    ) -> dict[tuple[str, str], torch.Tensor]:
        """Fresh output tensors for every op, carved from one allocation per dtype.

        One ``torch.empty`` instead of one per field: allocation is a large
        share of an eager plan's host time. Views start on 256-byte boundaries
        so kernels see the alignment a separate allocation would give them.
        """
        shapes = [(s, resolve_shape(s.spec.shape, dims, field=s.key)) for s in program.steps]
        offsets: dict[tuple[str, str], int] = {}
        totals: dict[torch.dtype, int] = {}
        for step, shape in shapes:
            align = max(1, 256 // step.spec.dtype.itemsize)
            start = totals.get(step.spec.dtype, 0)
            offsets[(step.backend, step.field)] = start
            totals[step.spec.dtype] = start + -(-math.prod(shape) // align) * align
        arenas = {dt: torch.empty(n, dtype=dt, device=self.device) for dt, n in totals.items()}
        out = {}
        for step, shape in shapes:
            key = (step.backend, step.field)
            start = offsets[key]
            out[key] = arenas[step.spec.dtype][start : start + math.prod(shape)].view(shape)
        return out

    # ---- capture --------------------------------------------------------------------------

    def _static_state(self, mode: ForwardMode) -> _Static:
        if mode not in self._static:
            program = self.program(mode)
            dims = self.dims(mode, self.limits.max_batch, self.limits.max_context)
            sources = self._sources(mode)
            layout = StagingLayout(
                [(s, t, p) for _, s, t, p in sources], self.limits.max_batch, program.next_n
            )
            buffers = {}
            for step in program.steps:
                shape = resolve_shape(step.spec.shape, dims, field=step.key)
                buffers[(step.backend, step.field)] = torch.zeros(
                    shape, dtype=step.spec.dtype, device=self.device
                )
            segments = {key: layout.segments[(s, p)] for key, s, _, p in sources}
            self._static[mode] = _Static(StaticStager(layout, self.device), buffers, segments)
        return self._static[mode]

    def static_bytes(self) -> int:
        """Bytes held in static buffers (plans and staging) for every captured mode."""
        total = 0
        for state in self._static.values():
            total += sum(t.numel() * t.element_size() for t in state.buffers.values())
            total += state.stager.device_buf.numel() * 4
        return total

    def _views(self, mode: ForwardMode, reqs: int) -> dict[tuple[str, str], torch.Tensor]:
        state = self._static_state(mode)
        dims = self.dims(mode, reqs, self.limits.max_context)
        views = {}
        for key, seg in state.segments.items():
            views[key] = state.stager.view(seg, dims["rows"] if seg.per_token else reqs)
        for step in self.program(mode).steps:
            key = (step.backend, step.field)
            shape = resolve_shape(step.spec.shape, dims, field=step.key)
            views[key] = (
                state.buffers[key][: shape[0]] if step.spec.batch_dim else state.buffers[key]
            )
        for alias, owner in self.program(mode).aliases.items():
            views[alias] = views[owner]
        return views

    def dummy_batch(self, bs: int, mode: ForwardMode, req_to_token: torch.Tensor) -> ForwardBatch:
        """A valid batch of ``bs`` requests at the shortest legal length, all on the null request."""
        next_n = self.program(mode).next_n
        return ForwardBatch(
            seq_lens_cpu=torch.full((bs,), next_n, dtype=torch.int32),
            req_pool_indices=torch.zeros(bs, dtype=torch.int32),
            req_to_token=req_to_token,
            out_cache_loc=torch.zeros(bs * next_n, dtype=torch.int32),
            mode=mode,
            next_n=next_n,
        )

    def capture(
        self, bs: int, mode: ForwardMode = ForwardMode.DECODE, *, req_to_token: torch.Tensor
    ) -> PlanSet:
        """Plans over static buffers for batches padded to ``bs``, filled from a dummy batch.

        Every op runs once here (warming up JIT kernels before the graph is
        captured). Call :meth:`record` inside the graph capture, before the layers.
        """
        return self._retrying(self._capture, bs, mode, req_to_token=req_to_token)

    def _capture(
        self, bs: int, mode: ForwardMode = ForwardMode.DECODE, *, req_to_token: torch.Tensor
    ) -> PlanSet:
        """See :meth:`capture`."""
        mode = ForwardMode(mode)
        if not 1 <= bs <= self.limits.max_batch:
            raise BatchError(
                "capture size out of range",
                field="bs",
                expected=f"[1, {self.limits.max_batch}]",
                actual=bs,
            )
        dummy = self.dummy_batch(bs, mode, req_to_token)
        self._validate(dummy, device_reads=True)
        state = self._static_state(mode)
        program = self.program(mode)
        state.stager.stage(dummy, bs, program.next_n, self._range_limits(mode, req_to_token))
        views = self._views(mode, bs)
        for step in program.steps:
            self._run_or_fall_back(step, views, dummy, static=True)
        dims = self.dims(mode, bs, self.limits.max_context)
        plans = PlanSet(self._build_plans(mode, views, dims), "capture", mode, bs, bs)
        named = [(f"{b}.{n}", t) for b, p in plans.items() for n, t in p.tensors().items()]
        self._captured[(mode, bs)] = _Capture(
            plans,
            views,
            [(key, t.data_ptr()) for key, t in named],
            [t for _, t in named],
            req_to_token.data_ptr(),
            tuple(req_to_token.shape),
            dummy,
        )
        self.stats.batches["capture"] += 1
        return plans

    def captured_sizes(self, mode: ForwardMode = ForwardMode.DECODE) -> list[int]:
        return sorted(bs for m, bs in self._captured if m is mode)

    def record(self, bs: int, mode: ForwardMode = ForwardMode.DECODE) -> None:
        """Run the graph-safe ops on the static views; call inside graph capture, before the layers."""
        capture = self._capture_for(ForwardMode(mode), bs)
        for step in self.program(ForwardMode(mode)).steps:
            if step.in_graph:
                self._run(step, capture.views, capture.dummy, static=True)

    def _capture_for(self, mode: ForwardMode, bs: int) -> _Capture:
        capture = self._captured.get((mode, bs))
        if capture is None:
            raise ReplayError(
                f"no capture for mode {mode.value} at this size",
                field="bs",
                expected=self.captured_sizes(mode),
                actual=bs,
            )
        return capture

    # ---- replay ---------------------------------------------------------------------------

    def replay(self, batch: ForwardBatch, bs: int | None = None) -> PlanSet:
        """Refresh the captured plans of size ``bs`` in place for ``batch``; return those same objects.

        Ops recorded in the graph run when the caller replays it; host ops
        (and, with ``ops_in_graph=False``, all ops) run here.
        """
        return self._retrying(self._replay, batch, bs)

    def _replay(self, batch: ForwardBatch, bs: int | None = None) -> PlanSet:
        """See :meth:`replay`."""
        start = time.perf_counter()
        self._validate(batch, device_reads=self.debug)
        mode = ForwardMode(batch.mode)
        bs = batch.bs if bs is None else bs
        if batch.bs > bs:
            raise BatchError(
                "batch larger than the replayed size",
                field="bs",
                expected=f"<= {bs}",
                actual=batch.bs,
            )
        capture = self._capture_for(mode, bs)
        table = batch.req_to_token
        if table.data_ptr() != capture.table_ptr or tuple(table.shape) != capture.table_shape:
            raise ReplayError(
                "req_to_token is not the table the graph was captured with (moved or reallocated)",
                field="req_to_token",
                expected=(hex(capture.table_ptr), capture.table_shape),
                actual=(hex(table.data_ptr()), tuple(table.shape)),
            )
        program = self.program(mode)
        limits = self._range_limits(mode, table)
        self._static[mode].stager.stage(batch, bs, program.next_n, limits)
        for step in program.steps:
            if not step.in_graph:
                self._run_or_fall_back(step, capture.views, batch, static=True)
        self._check_pointers(capture)
        capture.plans.real_reqs = batch.bs
        capture.plans.phase = "replay"
        self.stats.record_steps(mode, program.steps)
        self.stats.batches["replay"] += 1
        self.stats.host_seconds["replay"] += time.perf_counter() - start
        return capture.plans

    def _check_pointers(self, capture: _Capture) -> None:
        for tensor, (key, ptr) in zip(capture.tensors, capture.pointers):
            if tensor.data_ptr() != ptr:
                raise ReplayError(
                    "plan tensor moved since capture",
                    field=key,
                    expected=hex(ptr),
                    actual=hex(tensor.data_ptr()),
                )

    # ---- checks ---------------------------------------------------------------------------

    def _validate(self, batch: ForwardBatch, *, device_reads: bool) -> None:
        validate_batch(
            batch,
            device=self.device,
            max_batch=self.limits.max_batch,
            max_context=self.limits.max_context,
            next_n=self.limits.next_n,
            kv_slots=self.limits.kv_slots,
            device_reads=device_reads,
            host_ranges=not self._stages_lengths,
        )

    def verify(self, batch: ForwardBatch, plans: PlanSet) -> None:
        """Debug check after a replay: the replayed plans equal a fresh eager plan, bit for bit.

        Call after the graph has replayed (so graph-recorded ops have run).
        Also checks that padding rows hold the schemas' pad values.
        """
        eager = self._plan(batch, pad_to=plans.reqs, count=False)
        mismatches = diff_plans(plans, eager)
        program = self.program(plans.mode)
        real = {"reqs": batch.bs, "rows": batch.bs * program.next_n}
        bad_pad = padding_violations(plans, program.pads, real)
        self.stats.verified += 1
        if mismatches or bad_pad:
            if self.on_mismatch is not None:
                self.on_mismatch(batch, plans, eager)
            detail = "; ".join(
                [m.describe() for m in mismatches]
                + [f"{k}: padding rows hold wrong values" for k in bad_pad]
            )
            first = mismatches[0].backend + "." + mismatches[0].field if mismatches else bad_pad[0]
            raise ReplayError(
                f"replayed plan differs from eager (stale buffer, or a layer wrote into it): {detail}",
                field=first,
            )

    @contextmanager
    def guard(self, plans: Mapping[str, Plan]) -> Iterator[None]:
        """Debug mode: digest plans before and after the forward; a layer that wrote raises."""
        if not self.debug:
            yield
            return
        before = plan_digests(plans)
        yield
        after = plan_digests(plans)
        changed = sorted(k for k in before if before[k] != after[k])
        if changed:
            raise PlanWriteError(
                "a layer wrote into a plan it may only read", field=changed[0], actual=changed
            )
