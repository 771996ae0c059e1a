"""Turning schemas into a program: the op DAG ordered, providers chosen, params bound.

Built once per (planner, mode); each batch then only walks the list. This
is where a schema's mistakes (unknown op, cycle, missing setting, a dimension
that would make static buffers non-contiguous) surface, at start-up. Each
step runs its op through a :class:`~planner.ops.ProviderChain`, so a
provider that fails at run time is replaced right there, for good. A backend's
settings, and the checks of the user's options, are :mod:`planner.settings`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from planner.batch import (
    BATCH,
    BATCH_TABLES,
    HOST_INPUTS,
    SOURCES,
    VERIFY_ROWS_MODES,
    ForwardBatch,
    ForwardMode,
)
from planner.errors import SchemaError
from planner.ops import Provider, ProviderChain
from planner.schema import (
    BATCH_DIMS,
    PAD_DERIVED,
    Plan,
    TensorSpec,
    dim_names,
    parse_dim,
    resolve_setting,
)
from planner.settings import settings_for

Key = tuple[str, str]
"""Where a tensor lives in a batch's table: ``(backend, field)``, or ``(BATCH, name)``."""

ChainFor = Callable[[str, "str | None"], ProviderChain]
"""``chain_for(op_name, forced)``: the planner's one chain per op and forced provider."""


@dataclass(frozen=True)
class Step:
    """One op call of one backend, ready to run: the field it fills, or one field per named
    output of the op, in the op's output order (a step is known by its first)."""

    backend: str
    fields: tuple[str, ...]
    specs: tuple[TensorSpec, ...]
    op_name: str
    chain: ProviderChain
    inputs: tuple[str, ...]
    params: Mapping[str, Any]
    in_graph: bool
    input_keys: tuple[Key, ...] = ()
    """Where each input lives: a field after aliasing, or ``(BATCH, name)`` for the batch's own."""

    @property
    def field(self) -> str:
        return self.fields[0]

    @property
    def spec(self) -> TensorSpec:
        """The first field's spec (the op, inputs, params and binds are every field's)."""
        return self.specs[0]

    @property
    def key(self) -> str:
        return f"{self.backend}.{self.fields[0]}"

    @property
    def keys(self) -> tuple[str, ...]:
        """``backend.field`` of every field the step fills."""
        return tuple(f"{self.backend}.{name}" for name in self.fields)

    @property
    def output(self) -> Key:
        return (self.backend, self.fields[0])

    @property
    def outputs(self) -> tuple[Key, ...]:
        """Where every field the step fills lives, in the op's output order."""
        return tuple((self.backend, name) for name in self.fields)

    @property
    def provider(self) -> Provider:
        """The provider this step runs with now (it changes only if one fails)."""
        return self.chain.current

    def run(self, tensors: Mapping[Key, torch.Tensor], *, static: bool) -> Any:
        """Run the op over ``tensors`` into its output; a host op's handle, or None.

        Host ops learn whether their tensors are static views (capture and
        replay) or fresh (eager): FlashInfer binds a CUDA-graph wrapper to the
        former only.
        """
        args = [tensors[key] for key in self.input_keys]
        outs = [tensors[key] for key in self.outputs]
        graph_safe = self.chain.current.graph_safe
        params = self.params if graph_safe else {**self.params, "static": static}
        return self.chain.call(self.key, outs, args, params)


def batch_reads(steps: Iterable[Step], done: frozenset = frozenset()) -> frozenset[str]:
    """The batch's own tensors (``(BATCH, name)`` inputs) that the steps not in ``done`` read."""
    return frozenset(
        source[1]
        for step in steps
        if step.output not in done
        for source in step.input_keys
        if source[0] == BATCH
    )


@dataclass(frozen=True)
class Program:
    """Everything a mode needs per batch: settings, source fields, ordered steps."""

    mode: ForwardMode
    schemas: Mapping[str, type[Plan]]
    """The plan schema of each backend for this mode."""
    settings: Mapping[str, Any]
    steps: tuple[Step, ...]
    pads: Mapping[tuple[str, str], int | float | None]
    backend_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    aliases: Mapping[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """Op fields that compute exactly what an earlier field computes: they share its tensor."""
    setting_dims: Mapping[str, int] = field(init=False, repr=False, compare=False)
    """The integer settings, which every batch's dimensions start from (filtered once, not
    per batch: a dozen ``isinstance`` pairs cost microseconds on a GPU host)."""

    def __post_init__(self) -> None:
        ints = {
            k: v for k, v in self.settings.items() if isinstance(v, int) and not isinstance(v, bool)
        }
        object.__setattr__(self, "setting_dims", ints)

    @property
    def next_n(self) -> int:
        return int(self.settings["next_n"])

    def real_rows(self, batch: ForwardBatch) -> dict[str, int]:
        """How many leading entries of each batch dimension are real in a (step's) plan of
        ``batch``: the rest is padding, which must hold the schemas' pad values."""
        if self.mode.ragged:  # one row per query token, padding tokens after the real ones
            tokens = batch.num_tokens
            return {"reqs": batch.bs, "rows": tokens, "tokens": tokens, "kernel_reqs": tokens}
        rows = batch.bs * self.next_n
        tokens = batch.num_tokens if self.mode.padded_rows else rows
        kernel = rows // int(self.settings.get("kernel_next_n", 1))
        return {"reqs": batch.bs, "rows": rows, "tokens": tokens, "kernel_reqs": kernel}


def row_layout(mode: ForwardMode, next_n: int, natives: Iterable[Any]) -> dict[str, int]:
    """How kernels see a mode's ``next_n`` rows per request, from one declaration.

    Each backend may declare ``native_next_n``, the ``next_n`` its kernels take
    (absent: any). Rows are laid out natively (``kernel_next_n = next_n``)
    where every kernel of the batch takes them, else expanded: one kernel
    request per row (``kernel_next_n = 1``; per-request tables repeated
    ``row_repeat`` times; schedules over the expanded rows). Draft extend is
    always expanded: its padding rows break the staircase a native kernel
    computes up to the request's last row.
    """
    expanded = next_n > 1 and (
        mode.padded_rows or any(n is not None and next_n not in tuple(n) for n in natives)
    )
    return {"kernel_next_n": 1 if expanded else next_n, "row_repeat": next_n if expanded else 1}


def topological_fields(plan_cls: type[Plan]) -> list[str]:
    """Op fields of a schema, each after the fields it reads; a cycle is an error."""
    specs = plan_cls.tensor_specs
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise SchemaError(
                "op inputs form a cycle", field=plan_cls.backend, actual=" -> ".join(path + (name,))
            )
        state[name] = 1
        for dep in specs[name].inputs:
            if dep in specs:
                visit(dep, path + (name,))
        state[name] = 2
        if specs[name].op is not None:
            order.append(name)

    for name in specs:
        visit(name, ())
    return order


def check_static_shapes(plan_cls: type[Plan]) -> None:
    """Only the leading dimension may depend on the batch, so views of static buffers stay contiguous."""
    for name, spec in plan_cls.tensor_specs.items():
        for expr in spec.shape[1:]:
            if dim_names((expr,)) & BATCH_DIMS:
                raise SchemaError(
                    f"only the leading dimension may be one of {sorted(BATCH_DIMS)}",
                    field=f"{plan_cls.backend}.{name}",
                    actual=spec.shape,
                )
        if spec.source is not None:
            if spec.source not in SOURCES:
                raise SchemaError(
                    "unknown batch source",
                    field=f"{plan_cls.backend}.{name}",
                    expected=sorted(SOURCES),
                    actual=spec.source,
                )
            if (spec.row_dim in ("rows", "tokens")) != SOURCES[spec.source]:
                raise SchemaError(
                    "a per-token source is over 'rows' or 'tokens', a per-request one over 'reqs'",
                    field=f"{plan_cls.backend}.{name}",
                    actual=spec.shape,
                )
            if spec.dtype != torch.int32:
                raise SchemaError(
                    "source fields are staged as int32",
                    field=f"{plan_cls.backend}.{name}",
                    actual=spec.dtype,
                )
            if len(spec.shape) != 1 or spec.row_dim is None or parse_dim(spec.shape[0])[1] != 0:
                raise SchemaError(
                    "source fields are 1-D over 'reqs' or 'rows'",
                    field=f"{plan_cls.backend}.{name}",
                    actual=spec.shape,
                )


def build_program(
    schemas: Mapping[str, type[Plan]],
    base_settings: Mapping[str, Any],
    options: Mapping[str, Mapping[str, Any]],
    forced: Mapping[str, str],
    chain_for: ChainFor,
    mode: ForwardMode,
    ops_in_graph: bool,
) -> Program:
    """Order every backend's op fields, choose providers, resolve settings."""
    steps: list[Step] = []
    pads: dict[tuple[str, str], int | float | None] = {}
    settings_seen: dict[str, Any] = {}
    per_backend: dict[str, dict[str, Any]] = {}
    identity: dict[tuple[str, str], tuple] = {}  # what a field computes, across backends
    first: dict[tuple, tuple[str, str]] = {}
    aliases: dict[tuple[str, str], tuple[str, str]] = {}
    merged = {
        backend: settings_for(base_settings, cls, options.get(backend, {}), mode)
        for backend, cls in schemas.items()
    }
    next_n = int(base_settings["next_n"]) if mode in VERIFY_ROWS_MODES else 1
    layout = row_layout(mode, next_n, [s.get("native_next_n") for s in merged.values()])
    for backend, plan_cls in schemas.items():
        if not mode.ragged:  # ragged fields are flat views of their buffers (``(2, "tokens")``)
            check_static_shapes(plan_cls)
        settings = {**merged[backend], **layout}
        plan_cls.check_settings(settings)
        settings_seen.update(settings)
        per_backend[backend] = settings
        for name, spec in plan_cls.tensor_specs.items():
            pad = resolve_setting(spec.pad, settings, field=f"{backend}.{name}")
            pads[(backend, name)] = None if pad == PAD_DERIVED else pad
            if spec.source is not None:
                identity[(backend, name)] = ("source", spec.source, pad, spec.dtype)
        chains, calls = _op_calls(backend, plan_cls, forced, chain_for)
        chosen = {name: chain.current for name, chain in chains.items()}
        # Tensors a host op takes (e.g. to bind into a CUDA-graph wrapper) stay this backend's own.
        host_read = {
            i
            for n, p in chosen.items()
            if not p.graph_safe
            for i in plan_cls.tensor_specs[n].inputs
        }
        stepped: set[str] = set()
        for name in topological_fields(plan_cls):
            fields = calls[name]  # this field's call: the field, or every named output's
            if name in stepped:
                continue
            stepped.update(fields)
            specs = tuple(plan_cls.tensor_specs[f] for f in fields)
            spec = specs[0]
            key = f"{backend}.{name}"
            provider = chosen[name]
            params = {k: resolve_setting(v, settings, field=key) for k, v in spec.params.items()}
            what = (
                spec.op,
                provider.name,
                tuple(identity.get((backend, i), ("table", i)) for i in spec.inputs),
                tuple(sorted((k, repr(v)) for k, v in params.items())),
                tuple(s.shape for s in specs),
                tuple(s.dtype for s in specs),
            )
            for each in specs:
                identity[(backend, each.name)] = (what, each.output)
            op = chains[name].op
            if op.identity is not None and op.identity(params):
                # the op would copy its input unchanged (e.g. rows repeated once): share it
                source = aliases.get((backend, spec.inputs[0]), (backend, spec.inputs[0]))
                aliases[(backend, name)] = source
                identity[(backend, name)] = identity.get((backend, spec.inputs[0]), what)
                continue
            if provider.graph_safe and host_read.isdisjoint(fields) and what in first:
                owner, owned = first[what]  # computed once, read by both backends
                aliases.update(((backend, f), (owner, o)) for f, o in zip(fields, owned))
                continue
            first.setdefault(what, (backend, fields))
            steps.append(
                Step(
                    backend=backend,
                    fields=fields,
                    specs=specs,
                    op_name=spec.op,
                    chain=chains[name],
                    inputs=spec.inputs,
                    params=params,
                    in_graph=ops_in_graph
                    and provider.graph_safe
                    and not (set(spec.inputs) & HOST_INPUTS),
                    input_keys=tuple(
                        (BATCH, i)
                        if i in BATCH_TABLES | HOST_INPUTS
                        else aliases.get((backend, i), (backend, i))
                        for i in spec.inputs
                    ),
                )
            )
    steps = _hoist_host_dependencies(steps, aliases)
    return Program(
        mode=mode,
        schemas=dict(schemas),
        settings=settings_seen,
        steps=tuple(steps),
        pads=pads,
        backend_settings=per_backend,
        aliases=aliases,
    )


def _op_calls(
    backend: str, plan_cls: type[Plan], forced: Mapping[str, str], chain_for: ChainFor
) -> tuple[dict[str, ProviderChain], dict[str, tuple[str, ...]]]:
    """Each op field's provider chain, and the fields its one call fills: the field itself,
    or, for an op with named outputs, the field of each output in the op's order (the
    fields naming that op over the same inputs and params). A field naming an output the
    op lacks, two fields taking one output, or an output no field takes is refused."""
    specs = plan_cls.tensor_specs
    groups: dict[tuple, list[str]] = {}
    for name, spec in specs.items():
        if spec.op is not None:
            groups.setdefault(spec.call(), []).append(name)
    chains: dict[str, ProviderChain] = {}
    calls: dict[str, tuple[str, ...]] = {}
    for names in groups.values():
        op_name = specs[names[0]].op
        picks = {forced[k] for k in (f"{backend}.{n}" for n in names) if k in forced}
        if len(picks) > 1:
            raise SchemaError(
                "one op call's fields are forced onto different providers",
                field=f"{backend}.{names[0]}",
                actual=sorted(picks),
            )
        chain = chain_for(op_name, picks.pop() if picks else forced.get(op_name))
        outputs = chain.op.outputs
        named = [n for n in names if specs[n].output is not None]
        if not outputs:
            if named:
                raise SchemaError(
                    f"op {op_name!r} has one unnamed output: output= names none",
                    field=f"{backend}.{named[0]}",
                    actual=specs[named[0]].output,
                )
            chains.update((n, chain) for n in names)
            calls.update((n, (n,)) for n in names)
            continue
        by_output: dict[str, str] = {}
        for name in names:
            output = specs[name].output
            if output not in outputs:
                raise SchemaError(
                    f"op {op_name!r} has no output {output!r}"
                    if output is not None
                    else f"op {op_name!r} has named outputs: output= names the one taken",
                    field=f"{backend}.{name}",
                    expected=list(outputs),
                    actual=output,
                )
            if output in by_output:
                raise SchemaError(
                    f"two fields take output {output!r} of one {op_name!r} call",
                    field=f"{backend}.{name}",
                    actual=[by_output[output], name],
                )
            by_output[output] = name
        missing = [o for o in outputs if o not in by_output]
        if missing:
            raise SchemaError(
                f"op {op_name!r} writes every output it names: declare a field for each, "
                "with the same op, inputs and params",
                field=f"{backend}.{names[0]}",
                expected=list(outputs),
                actual=missing,
            )
        fields = tuple(by_output[o] for o in outputs)
        chains.update((n, chain) for n in names)
        calls.update((n, fields) for n in names)
    return chains, calls


def _hoist_host_dependencies(
    steps: list[Step], aliases: Mapping[tuple[str, str], tuple[str, str]]
) -> list[Step]:
    """A host op's inputs must be ready before the graph replays: run them outside too."""
    by_key = {key: s for s in steps for key in s.keys}  # every field, to the step filling it
    outside = {s.key for s in steps if not s.in_graph}
    changed = True
    while changed:
        changed = False
        for step in steps:
            if step.key not in outside:
                continue
            for dep in step.inputs:
                if dep in step.spec.binds:  # bound by address, never read: may stay in the graph
                    continue
                owner, name = aliases.get((step.backend, dep), (step.backend, dep))
                producer = by_key.get(f"{owner}.{name}")
                if producer is not None and producer.key not in outside and dep not in BATCH_TABLES:
                    outside.add(producer.key)
                    changed = True
    return [
        s if (s.key in outside) != s.in_graph else replace(s, in_graph=s.key not in outside)
        for s in steps
    ]


def warm_up(programs: Iterable[Program], limits: Any, device: torch.device) -> None:
    """Each chosen provider's warm-up hook, once per distinct op, provider and params.

    A JIT compile (deep_gemm compiles its schedule per 32-row bucket, 1-2 s
    each) inside a graph capture or mid-serving would stall or break it.
    """
    seen = set()
    for program in programs:
        for step in program.steps:
            provider = step.provider
            key = (step.op_name, provider.name, repr(sorted(step.params.items())))
            if provider.warmup is not None and key not in seen:
                seen.add(key)
                provider.warmup(limits, step.params, device)


def batch_dims(
    program: Program,
    page_size: int,
    num_sms: int,
    *,
    reqs: int,
    max_len: int,
    tokens: int,
    kv_tokens: int,
) -> dict:
    """Values of the symbolic dimensions for ``reqs`` requests of at most ``max_len`` KV tokens,
    ``tokens`` query tokens and ``kv_tokens`` KV tokens in all (those it derives are
    :data:`planner.settings.DERIVED_DIMS`, which no option may set)."""
    dims = dict(program.setting_dims)
    pages = -(-max_len // page_size)
    dims.update(
        reqs=reqs,
        rows=tokens,
        tokens=tokens,
        kernel_reqs=tokens // int(program.settings.get("kernel_next_n", 1)),
        kv_tokens=kv_tokens,
        max_len=max_len,
        pages=pages,
        req_pages=reqs * pages,
        sms=num_sms,
        next_n=program.next_n,
    )
    for backend, cls in program.schemas.items():
        extra = cls.derived_dims(dims, program.backend_settings[backend])
        if not extra.keys().isdisjoint(dims):
            clash = set(extra) & set(dims)
            raise SchemaError(
                "a derived dimension takes a name already in use",
                field=f"{backend}.derived_dims",
                actual=sorted(clash),
            )
        dims.update(extra)
    return dims
