"""Metadata ops: named functions with exact semantics and several providers.

An op is the unit the planner schedules once per batch. Each provider
implements the same semantics (``torch`` is the exact reference and always
exists; ``triton``, ``deep_gemm``, ``flashinfer`` where they apply), writes
into the output buffer it is given, and declares whether it may run inside
a CUDA graph (device work only, no host sync) or needs the host.

Each step of a planner runs its op through a :class:`ProviderChain`: a JIT compile error
or a broken optional install shows up on the first call, not at import, and serving must
go on with the next best provider for that op (same graph safety, so where the step runs
does not change), say so once, and never try the failed one again. The torch reference is
never replaced (its failure is a bug to surface), nor a provider the config forced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from planner.errors import PlanError, ProviderError, SchemaError, warn_once
from planner.registry import load_backends

if TYPE_CHECKING:
    from planner.limits import Limits

ProviderFn = Callable[..., Any]
"""``fn(out, *inputs, **params)``: writes ``out``; a host op may return a handle for the plan.
An op with named outputs takes one buffer per output first, in their declared order:
``fn(out_a, out_b, *inputs, **params)``, and writes every one of them."""

WarmupFn = Callable[["Limits", Mapping[str, Any], torch.device], None]
"""``warmup(limits, params, device)``: compile what the provider JITs, before graphs are captured."""

DEFAULT_RANKS = {"deep_gemm": 0, "flashinfer": 0, "triton": 10, "torch": 100}
"""Preference on CUDA (lower first). On the CPU only ``torch`` is chosen unless forced."""


def _always(device: torch.device) -> bool:
    return True


@dataclass(frozen=True)
class Provider:
    """One implementation of an op."""

    name: str
    fn: ProviderFn
    graph_safe: bool
    available: Callable[[torch.device], bool]
    rank: int
    warmup: WarmupFn | None = None
    """Run by ``Planner.warm_up`` once per planner with each step's params (e.g. JIT buckets)."""

    def is_available(self, device: torch.device) -> bool:
        """Importable and usable on ``device``; an import failure counts as unavailable."""
        try:
            return bool(self.available(device))
        except Exception as exc:  # a broken optional library must not break planning
            warn_once(f"{self.name}: availability check failed ({exc!r}); treating as unavailable")
            return False


@dataclass
class MetadataOp:
    """A named op and its providers; ``torch`` must be among them."""

    name: str
    doc: str
    providers: dict[str, Provider] = field(default_factory=dict)
    identity: Callable[[Mapping[str, Any]], bool] | None = None
    """``identity(params)``: True when the op returns its first input unchanged for these
    params (rows repeated once): the planner then shares that input instead of running it."""
    outputs: tuple[str, ...] = ()
    """Named outputs of an op whose one call fills several fields (FlashMLA's
    ``get_mla_metadata`` returns a schedule and split offsets computed together); each field
    names the one it takes with ``tensor_field(..., output=)``. Empty: one unnamed output."""

    def provider(
        self,
        name: str,
        *,
        graph_safe: bool = True,
        available: Callable[[torch.device], bool] | None = None,
        rank: int | None = None,
        warmup: WarmupFn | None = None,
    ) -> Callable[[ProviderFn], ProviderFn]:
        """Decorator registering ``fn(out, *inputs, **params)`` as provider ``name`` (an op
        with named outputs: ``fn(out_a, out_b, ..., *inputs, **params)``)."""

        def register(fn: ProviderFn) -> ProviderFn:
            if name in self.providers:
                raise SchemaError(f"op {self.name!r} already has provider {name!r}")
            self.providers[name] = Provider(
                name=name,
                fn=fn,
                graph_safe=graph_safe,
                available=available or _always,
                rank=DEFAULT_RANKS.get(name, 50) if rank is None else rank,
                warmup=warmup,
            )
            return fn

        return register

    def select(self, device: torch.device, forced: str | None = None) -> Provider:
        """The provider to run on ``device``: forced by config, else the best available.

        On the CPU only the torch reference is chosen automatically: the
        Triton interpreter is for tests, not for serving.
        """
        if "torch" not in self.providers:
            raise ProviderError(
                f"op {self.name!r} has no torch reference provider", field=self.name
            )
        if forced is not None:
            provider = self.providers.get(forced)
            if provider is None:
                raise ProviderError(
                    "unknown provider",
                    field=self.name,
                    expected=sorted(self.providers),
                    actual=forced,
                )
            if not provider.is_available(device):
                raise ProviderError(
                    f"forced provider is not available on {device}",
                    field=self.name,
                    expected=self.available_on(device),
                    actual=forced,
                )
            return provider
        if device.type != "cuda":
            return self.providers["torch"]
        usable = [p for p in self.providers.values() if p.is_available(device)]
        return min(usable, key=lambda p: (p.rank, p.name))

    def available_on(self, device: torch.device) -> list[str]:
        """Names of the providers usable on ``device``."""
        return sorted(name for name, p in self.providers.items() if p.is_available(device))


_OPS: dict[str, MetadataOp] = {}


def metadata_op(
    name: str,
    doc: str,
    *,
    identity: Callable[[Mapping[str, Any]], bool] | None = None,
    outputs: Sequence[str] = (),
) -> MetadataOp:
    """Create and register an op; providers are added with ``@op.provider(...)``.

    ``outputs`` names the outputs of an op that fills several fields in one call (at least
    two, distinct); its providers take one buffer per output, in this order, before the
    inputs."""
    if name in _OPS:
        raise SchemaError(f"metadata op {name!r} is already registered")
    outputs = tuple(outputs)
    if outputs and (len(outputs) < 2 or len(set(outputs)) != len(outputs)):
        raise SchemaError(
            "named outputs are two or more distinct names (one output needs none)",
            field=name,
            actual=list(outputs),
        )
    if outputs and identity is not None:
        raise SchemaError("an op with named outputs cannot be an identity", field=name)
    op = MetadataOp(name=name, doc=doc, identity=identity, outputs=outputs)
    _OPS[name] = op
    return op


def get_op(name: str) -> MetadataOp:
    """The registered op ``name``; loads the installed backends first."""
    load_backends()
    if name not in _OPS:
        raise SchemaError("unknown metadata op", field=name, expected=sorted(_OPS))
    return _OPS[name]


def all_ops() -> Mapping[str, MetadataOp]:
    """Every registered op by name."""
    load_backends()
    return dict(_OPS)


_RUNNING: ContextVar[tuple[str, str, str] | None] = ContextVar("running_provider", default=None)
_guards = 0


@contextmanager
def guarding_capture() -> Iterator[None]:
    """A graph capture's guard is on (``graphs.capture_guard``, the CPU's emulated capture):
    :func:`running_provider` says which provider runs, so the guard can name it, and
    :func:`capture_guarded` is True. Off, a provider call sets nothing (the hot path)."""
    global _guards
    _guards += 1
    try:
        yield
    finally:
        _guards -= 1


def capture_guarded() -> bool:
    """True while a capture's guard is on: a check that reads values only off CUDA (where
    reading them would sync) skips them here too, as it does under a CUDA capture."""
    return _guards > 0


def running_provider() -> tuple[str, str, str] | None:
    """``(plan field, op, provider)`` of the provider call running now, under
    :func:`guarding_capture`; None outside one (or when no guard is on)."""
    return _RUNNING.get()


class ProviderChain:
    """The provider an op runs with in one planner, and the ones it may fall back to."""

    def __init__(self, op: MetadataOp, device: torch.device, forced: str | None) -> None:
        self.op = op
        self.device = device
        self.forced = forced
        self.current: Provider = op.select(device, forced)
        self.retired: set[str] = set()

    def call(
        self, key: str, outs: Sequence[torch.Tensor], args: Sequence[Any], params: Mapping[str, Any]
    ) -> Any:
        """Run the current provider over the output buffers ``outs`` (one, or one per named
        output) and return what it returns (a host op's handle, or None).

        On failure the provider is retired and the next best runs on the same
        inputs; providers write every element of every output, so a retry over a
        half-written output is exact.
        """
        while True:
            provider = self.current
            try:
                if not _guards:  # the hot path: nothing is set unless a capture guard is on
                    return provider.fn(*outs, *args, **params)
                token = _RUNNING.set((key, self.op.name, provider.name))
                try:
                    return provider.fn(*outs, *args, **params)
                finally:
                    _RUNNING.reset(token)
            except PlanError:
                raise
            except Exception as exc:
                if provider.name == "torch":
                    raise
                if self.forced is not None:
                    raise ProviderError(
                        f"forced provider failed: {exc!r}", field=key, actual=provider.name
                    ) from exc
                self._retire(provider, exc)

    def _retire(self, failed: Provider, exc: Exception) -> None:
        self.retired.add(failed.name)
        usable = [
            p
            for p in self.op.providers.values()
            if p.name not in self.retired
            and p.graph_safe == failed.graph_safe
            and p.is_available(self.device)
        ]
        if not usable:
            raise ProviderError(
                f"every provider failed, the last with {exc!r}", field=self.op.name
            ) from exc
        self.current = min(usable, key=lambda p: (p.rank, p.name))
        warn_once(
            f"{self.op.name}: provider {failed.name!r} failed ({type(exc).__name__}: {exc}); "
            f"using {self.current.name!r} from now on"
        )
