"""Plan schemas: what a backend's kernels read, declared once.

A backend subclasses :class:`Plan` and declares every tensor its layers read
with :func:`tensor_field` (dtype, symbolic shape, pad value, producer) and every
host scalar with :func:`scalar_field`. The planner derives everything else from
these declarations: the op DAG, static buffer sizes, what gets staged from the
batch, what padding rows must hold. Nothing about metadata lives in layers.

Shapes are symbolic (``("reqs", "pages")``) because the same field has two sizes: the
batch's own in an eager plan, and the static maximum in a captured one. A dimension is an
int, a name, or ``name+int`` / ``name-int`` (``"reqs+1"``, ``"sms+1"``).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from planner.batch import BATCH_TABLES, DECODE_MODES, HOST_INPUTS, ForwardMode
from planner.errors import PlanWriteError, SchemaError
from planner.registry import register_backend

DimExpr = int | str

_EXPR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:([+-])\s*(\d+))?\s*$")


@functools.lru_cache(maxsize=4096)
def parse_dim(expr: DimExpr) -> tuple[str | None, int]:
    """Split a dimension expression into (name, offset); a literal has no name."""
    if isinstance(expr, bool):
        raise SchemaError("dimension must be an int or a name", expected="int|str", actual=expr)
    if isinstance(expr, int):
        if expr < 0:
            raise SchemaError("dimension literal is negative", expected=">= 0", actual=expr)
        return None, expr
    match = _EXPR.match(expr)
    if match is None:
        raise SchemaError(
            "cannot parse dimension", expected="'name', 'name+N' or 'name-N'", actual=expr
        )
    name, sign, number = match.groups()
    offset = int(number) if number else 0
    return name, -offset if sign == "-" else offset


def dim_names(shape: Sequence[DimExpr]) -> set[str]:
    """The symbolic names a shape depends on."""
    return {name for name, _ in map(parse_dim, shape) if name is not None}


def resolve_shape(
    shape: Sequence[DimExpr], dims: Mapping[str, int], *, field: str = "?"
) -> tuple[int, ...]:
    """Numbers for a symbolic shape, given the values of its names."""
    out = []
    for expr in shape:
        name, offset = parse_dim(expr)
        if name is None:
            out.append(offset)
            continue
        if name not in dims:
            raise SchemaError(
                f"shape uses unknown dimension {name!r}", field=field, expected=sorted(dims)
            )
        size = dims[name] + offset
        if size < 0:
            raise SchemaError("dimension resolves negative", field=field, actual=(expr, size))
        out.append(size)
    return tuple(out)


Tensor = Annotated[torch.Tensor, WithJsonSchema({"type": "object", "title": "Tensor"})]
"""Annotation for tensor fields of a plan (a torch tensor, described in JSON Schema)."""

BATCH_DIMS = frozenset({"reqs", "rows", "tokens", "kernel_reqs", "req_pages", "kv_tokens"})
"""Dimensions that grow with the batch.

``reqs``: requests; ``rows``: query rows of a uniform batch (``reqs * next_n``);
``tokens``: query tokens of any batch (the extend lengths' sum; ``rows`` when
uniform); ``kernel_reqs``: the requests a kernel sees, ``rows / kernel_next_n``
(``reqs`` when the kernel takes ``next_n`` rows per request natively, ``rows``
when they are expanded to one row each); ``req_pages``: ``reqs * pages`` (flat
page lists); ``kv_tokens``: the KV lengths' sum (a flat gathered KV).
"""

ROW_DIMS = ("reqs", "rows", "tokens", "kernel_reqs")
"""Leading dimensions whose trailing entries are padding rows in a padded batch."""

PAD_DERIVED = "derived"
"""Pad marker: padding rows hold what the op computes from padded inputs (e.g. prefix sums)."""


@dataclass(frozen=True)
class Setting:
    """A value taken from the planner's settings (limits or backend options) at build time.

    Used for op parameters and pad values that depend on the deployment
    (``page_size``, ``next_n``, ``topk``), so one schema serves every config.
    """

    name: str

    def __repr__(self) -> str:
        return f"${self.name}"


def resolve_setting(value: Any, settings: Mapping[str, Any], *, field: str) -> Any:
    """Replace a :class:`Setting` by its value; leave constants alone."""
    if not isinstance(value, Setting):
        return value
    if value.name not in settings:
        raise SchemaError(
            f"needs setting {value.name!r}, which neither the limits nor the backend options define",
            field=field,
            expected=sorted(settings),
        )
    return settings[value.name]


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor field of a plan is shaped, padded and produced.

    Exactly one of ``source`` (a batch input staged as is) and ``op`` (a
    registered metadata op over ``inputs``) is set. ``output`` names the output taken from
    an op with named outputs: the fields naming one op over the same inputs and params
    are filled by one call.
    """

    dtype: torch.dtype
    shape: tuple[DimExpr, ...]
    pad: int | float | str | Setting | None
    source: str | None = None
    op: str | None = None
    inputs: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    binds: tuple[str, ...] = ()
    doc: str = ""
    name: str = ""
    output: str | None = None

    def call(self) -> tuple:
        """What one op call is: fields with the same call share it (one per named output)."""
        params = tuple(sorted((k, repr(v)) for k, v in self.params.items()))
        return (self.op, self.inputs, params, self.binds)

    @property
    def row_dim(self) -> str | None:
        """The batch dimension (``reqs``, ``rows`` or ``tokens``) padding applies to, if any."""
        first, _ = parse_dim(self.shape[0]) if self.shape else (None, 0)
        return first if first in ROW_DIMS else None

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON: for JSON Schema export and dumps."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "pad": repr(self.pad) if isinstance(self.pad, Setting) else self.pad,
            "source": self.source,
            "op": self.op,
            "inputs": list(self.inputs),
            "params": {k: repr(v) if isinstance(v, Setting) else v for k, v in self.params.items()},
            "binds": list(self.binds),
            **({"output": self.output} if self.output is not None else {}),
        }


@dataclass(frozen=True)
class ScalarSpec:
    """A host integer of a plan, equal to a dimension or a setting.

    Under CUDA graphs a scalar is baked into the graph at capture, so a
    captured plan holds the static bound (``max_len`` is ``max_context``), an
    eager plan the batch's own value.
    """

    value: str
    doc: str = ""
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value}


@dataclass(frozen=True)
class HandleSpec:
    """A host object a host op returns along with its tensor field (e.g. the wrapper it planned).

    Not a tensor and not a number: it is neither compared nor dumped, only
    carried, so the layer that reads the plan finds the very object the
    planner prepared for this plan, with no lookup of its own.
    """

    of: str
    doc: str = ""
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"handle_of": self.of}


def tensor_field(
    dtype: torch.dtype,
    shape: tuple[DimExpr, ...],
    *,
    source: str | None = None,
    op: str | None = None,
    inputs: tuple[str, ...] = (),
    params: Mapping[str, Any] | None = None,
    pad: int | float | str | Setting | None = None,
    binds: tuple[str, ...] = (),
    output: str | None = None,
    doc: str = "",
) -> Any:
    """Declare a tensor field; use as the default of a ``Tensor`` annotation.

    ``binds`` names inputs a host op takes for their address only (it binds
    them, e.g. as a FlashInfer CUDA-graph wrapper's buffers, and never reads
    their values): their ops stay inside the graph instead of being hoisted.
    ``output`` names the output this field takes of an op declared with named outputs
    (``metadata_op(..., outputs=(...))``); give every output's field the same ``op``,
    ``inputs`` and ``params``, and the op runs once for them all.
    """
    if output is not None and op is None:
        raise SchemaError("output= names an output of an op: it needs op=", actual=output)
    if not set(binds) <= set(inputs):
        raise SchemaError(
            "binds= must name inputs of the field", expected=list(inputs), actual=list(binds)
        )
    if (source is None) == (op is None):
        raise SchemaError("a tensor field needs exactly one of source= or op=", actual=(source, op))
    if pad is None:
        raise SchemaError(
            "a tensor field must declare pad= (a value, a Setting, or PAD_DERIVED)",
            actual=(source or op),
        )
    for expr in shape:
        parse_dim(expr)
    spec = TensorSpec(
        dtype=dtype,
        shape=tuple(shape),
        pad=pad,
        source=source,
        op=op,
        inputs=tuple(inputs),
        params=dict(params or {}),
        binds=tuple(binds),
        doc=doc,
        output=output,
    )
    info = Field(description=doc or None, json_schema_extra={"plan": spec.to_json()})
    info.metadata.append(spec)
    return info


def scalar_field(value: str, *, doc: str = "") -> Any:
    """Declare a host integer equal to a dimension (``max_len``) or a setting (``topk``)."""
    spec = ScalarSpec(value=value, doc=doc)
    info = Field(description=doc or None, json_schema_extra={"plan": spec.to_json()})
    info.metadata.append(spec)
    return info


def handle_field(of: str, *, doc: str = "") -> Any:
    """Declare the object the host op producing tensor field ``of`` returns for this plan."""
    spec = HandleSpec(of=of, doc=doc)
    info = Field(description=doc or None, json_schema_extra={"plan": spec.to_json()})
    info.metadata.append(spec)
    return info


Handle = Annotated[Any, WithJsonSchema({"type": "object", "title": "Handle"})]
"""Annotation for handle fields of a plan (a host object, opaque in JSON Schema)."""


class Plan(BaseModel):
    """Base class of every backend's plan: frozen, typed, read-only to layers.

    Subclass with ``class MyPlan(Plan, backend="mine")`` to register it. The
    planner builds instances without re-validating each step (it checked the
    tensors itself, with better messages); constructing one by hand validates
    every field against its spec.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    backend: ClassVar[str] = ""
    version: ClassVar[int] = 1
    modes: ClassVar[frozenset[ForwardMode]] = DECODE_MODES
    """The forward modes this schema plans; a backend may register one schema per set of modes.
    Draft decode needs none of its own: its steps are decode batches."""
    row_mask: ClassVar[str | None] = None
    """A ``rows`` field that is 0 on padding rows inside real requests (draft extend's rows
    past a request's accepted tokens): the padding checks cover those rows too."""
    defaults: ClassVar[Mapping[str, Any]] = {}
    """The backend's own options and their values when the user gives none (a ``Setting``
    in a field may also name a limit, or the row layout's ``kernel_next_n`` and
    ``row_repeat``). An option a user gives must be one of these or a ``Setting`` a field
    names, of its default's type; an integer setting is also a dimension shapes may use."""
    tensor_specs: ClassVar[dict[str, TensorSpec]] = {}
    scalar_specs: ClassVar[dict[str, ScalarSpec]] = {}
    handle_specs: ClassVar[dict[str, HandleSpec]] = {}

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            first = exc.errors()[0]
            original = first.get("ctx", {}).get("error")
            if isinstance(original, SchemaError):
                raise original from None
            where = ".".join(str(p) for p in first["loc"]) or "*"
            raise SchemaError(
                f"invalid {type(self).__name__}: {first['msg']}", field=f"{self.backend}.{where}"
            ) from None

    def __init_subclass__(
        cls,
        backend: str | None = None,
        version: int = 1,
        modes: frozenset[ForwardMode] | None = None,
        **kwargs: Any,
    ):
        super().__init_subclass__(**kwargs)
        if backend is not None:
            cls.backend = backend
            cls.version = version
        if modes is not None:
            cls.modes = frozenset(ForwardMode(m) for m in modes)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        tensors: dict[str, TensorSpec] = {}
        scalars: dict[str, ScalarSpec] = {}
        handles: dict[str, HandleSpec] = {}
        for name, info in cls.model_fields.items():
            for meta in info.metadata:
                if isinstance(meta, TensorSpec):
                    tensors[name] = _named(meta, name)
                elif isinstance(meta, ScalarSpec):
                    scalars[name] = _named(meta, name)
                elif isinstance(meta, HandleSpec):
                    handles[name] = _named(meta, name)
        cls.tensor_specs = tensors
        cls.scalar_specs = scalars
        cls.handle_specs = handles
        _check_hooks(cls)
        _check_inputs(cls)
        if cls.backend and "backend" in cls.__dict__:
            register_backend(cls)

    @model_validator(mode="after")
    def _check_tensors(self) -> Plan:
        for name, spec in self.tensor_specs.items():
            tensor = getattr(self, name)
            if tensor.dtype != spec.dtype:
                raise SchemaError(
                    "wrong dtype",
                    field=f"{self.backend}.{name}",
                    expected=spec.dtype,
                    actual=tensor.dtype,
                )
            if tensor.dim() != len(spec.shape):
                raise SchemaError(
                    "wrong rank",
                    field=f"{self.backend}.{name}",
                    expected=f"{len(spec.shape)} dims {spec.shape}",
                    actual=tuple(tensor.shape),
                )
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        """Plans are read-only: refused with the library's one-line error naming
        ``backend.field`` (pydantic's frozen check would raise a multi-line
        ``ValidationError``). Construction never comes here (``model_construct``, validation
        and ``model_copy`` set ``__dict__`` themselves), so building a plan costs nothing more.
        Private attributes a subclass declares stay pydantic's to set."""
        if name in self.__private_attributes__:
            super().__setattr__(name, value)
            return
        raise PlanWriteError(
            "a plan is read-only: layers may only read it (model_copy(update=...) makes a "
            "changed copy)",
            field=f"{self.backend or type(self).__name__}.{name}",
        )

    def __delattr__(self, name: str) -> None:
        """Plans are read-only: deleting a field is refused like assigning one."""
        if name in self.__private_attributes__:
            super().__delattr__(name)
            return
        raise PlanWriteError(
            "a plan is read-only: its fields cannot be deleted",
            field=f"{self.backend or type(self).__name__}.{name}",
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in declaration order."""
        return {name: getattr(self, name) for name in self.tensor_specs}

    def scalars(self) -> dict[str, int]:
        """The host scalars by name."""
        return {name: getattr(self, name) for name in self.scalar_specs}

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Refuse settings this backend's kernels cannot take (accepts all by default).

        Called at planner build, once per mode, with the backend's merged settings (the
        limits, then :attr:`defaults`, then the user's options, then ``next_n`` and the row
        layout): raise a ``SchemaError`` naming ``backend.option`` and the limit, so a bad
        option fails at start-up, not at the first batch.
        """

    @classmethod
    def derived_dims(cls, dims: Mapping[str, int], settings: Mapping[str, Any]) -> dict[str, int]:
        """Dimensions of this backend's own that follow from the batch's (none by default).

        For a kernel whose launch shape depends on the batch size through a
        heuristic (a split count chosen to fill the SMs): it is a pure function
        of the batch's dimensions and the settings, so the planner resolves it
        like any dimension, static buffers are sized for the largest value over
        every batch size, and plans carry it as a scalar. Names are the
        backend's to choose, distinct from the planner's dimensions.
        """
        return {}

    @classmethod
    def required_dims(cls) -> set[str]:
        """Every symbolic dimension this schema's shapes use."""
        names: set[str] = set()
        for spec in cls.tensor_specs.values():
            names |= dim_names(spec.shape)
        return names


HOOKS = ("defaults", "check_settings", "derived_dims", "row_mask", "modes")
"""What a subclass may override: a name close to one of these is a misspelling, refused."""


def _check_hooks(cls: type[Plan]) -> None:
    """A misspelt hook would be silently ignored (the base class's runs instead): refuse a
    subclass's public name close to a hook's, a hook that is not a classmethod, and
    ``defaults`` that are not a mapping."""
    for name in [*vars(cls), *cls.model_fields]:
        if name.startswith("_") or name in HOOKS:
            continue
        close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.8)
        if close:
            raise SchemaError(
                f"{name!r} is not a Plan hook: did you mean {close[0]!r}?",
                field=f"{cls.__name__}.{name}",
                expected=list(HOOKS),
            )
    for name in ("check_settings", "derived_dims"):
        own = vars(cls).get(name)
        if own is not None and not isinstance(own, classmethod):
            raise SchemaError(
                "a Plan hook must be a classmethod", field=f"{cls.__name__}.{name}", actual=own
            )
    if not isinstance(cls.defaults, Mapping):
        raise SchemaError(
            "defaults must be a mapping of option to value",
            field=f"{cls.__name__}.defaults",
            actual=type(cls.defaults).__name__,
        )


def _named(spec: Any, name: str) -> Any:
    return type(spec)(**{**spec.__dict__, "name": name})


def _check_inputs(cls: type[Plan]) -> None:
    """Op inputs must name fields of the same plan or known batch tables; handles, op fields."""
    for name, handle in cls.handle_specs.items():
        spec = cls.tensor_specs.get(handle.of)
        if spec is None or spec.op is None:
            raise SchemaError(
                "a handle belongs to an op field of the same plan",
                field=name,
                expected=sorted(n for n, s in cls.tensor_specs.items() if s.op),
                actual=handle.of,
            )
    for name, spec in cls.tensor_specs.items():
        for source in spec.inputs:
            if source not in cls.tensor_specs and source not in BATCH_TABLES | HOST_INPUTS:
                raise SchemaError(
                    f"op input {source!r} is neither a field of {cls.__name__} nor a batch table",
                    field=name,
                    expected=sorted(cls.tensor_specs) + sorted(BATCH_TABLES | HOST_INPUTS),
                )
