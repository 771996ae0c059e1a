"""Two adjacent steps of an eager plan in one launch, where a provider offers it.

Why: on a GPU host each launch of a small metadata kernel costs tens of microseconds of
Python before the driver call (31-34 us on the H200's host, ``benchmarks/eager_pieces``),
and an eager NSA decode plan leaves two such steps after its host pass. A backend may
register a function that runs two ops' providers as one launch (``fused``); the eager
path then runs a pair of adjacent steps through it while both steps' chains still hold
that provider.

Nothing else changes: the two steps keep their outputs, inputs and parameters, each
result must be bit-equal to the two providers run one after the other (tests hold each
fusion to that), and where the fused call fails it is retired with a notice and the
steps run one by one through their own chains. Captures keep running the steps one by
one: inside a graph a launch costs no host time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from planner.errors import PlanError
from planner.kernel_launch import KernelLaunch
from planner.notices import warn_once
from planner.ops import MetadataOp
from planner.program import Key, Step

FusedFn = Callable[
    [
        tuple[torch.Tensor, torch.Tensor],
        tuple[Sequence[Any], Sequence[Any]],
        tuple[Mapping[str, Any], Mapping[str, Any]],
    ],
    None,
]
"""``fn(outs, args, params)``: both steps' outputs, inputs and parameters, in order."""
LaunchOf = Callable[
    [
        tuple[torch.Tensor, torch.Tensor],
        tuple[Sequence[Any], Sequence[Any]],
        tuple[Mapping[str, Any], Mapping[str, Any]],
    ],
    KernelLaunch | None,
]
"""``launch_of(outs, args, params)``: the launch ``fn`` would make of them, or None."""


@dataclass(frozen=True)
class Fusion:
    """``first`` then ``second``, both with ``provider``, as one call of ``fn``."""

    first: str
    second: str
    provider: str
    fn: FusedFn
    launch_of: LaunchOf | None = None
    """The launch ``fn`` would make, as a ``KernelLaunch`` (``planner.kernel_launch``), or
    None where it cannot say: for the eager lane's C submission of a layout it plans again."""

    @property
    def ops(self) -> tuple[str, str]:
        return (self.first, self.second)


_FUSIONS: dict[tuple[str, str], Fusion] = {}


def fused(
    first: MetadataOp, second: MetadataOp, provider: str, *, launch_of: LaunchOf | None = None
) -> Callable[[FusedFn], FusedFn]:
    """Decorator registering ``fn`` as ``provider``'s one launch of ``first`` then ``second``
    (``launch_of``: the launch it makes, taking the same arguments; see ``Fusion``)."""

    def register(fn: FusedFn) -> FusedFn:
        for op in (first, second):
            if provider not in op.providers:
                raise ValueError(f"op {op.name!r} has no provider {provider!r} to fuse")
        key = (first.name, second.name)
        if key in _FUSIONS:
            raise ValueError(f"ops {key} already have a fusion")
        _FUSIONS[key] = Fusion(first.name, second.name, provider, fn, launch_of)
        return fn

    return register


@dataclass(frozen=True)
class FusedSteps:
    """Two adjacent steps run as one launch while both hold the fusion's provider."""

    first: Step
    second: Step
    fusion: Fusion
    retired: set[tuple[str, str]] = field(default_factory=set, compare=False)
    """The planner's retired fusions (shared by all its storages, as a provider's
    retirement is shared by all its steps): one failure turns the pair off for good."""

    @property
    def output(self) -> Key:
        """The last output it writes, where ``run_steps`` looks (it returns no handle)."""
        return self.second.output

    def active(self) -> bool:
        """Whether the fused launch runs: both steps still hold its provider, and it has not
        failed."""
        name, fusion = self.fusion.provider, self.fusion
        return (
            self.first.chain.current.name == name
            and self.second.chain.current.name == name
            and fusion.ops not in self.retired
        )

    def _operands(self, tensors: Mapping[Key, torch.Tensor]) -> tuple[tuple, tuple]:
        first, second = self.first, self.second
        outs = (tensors[first.output], tensors[second.output])
        args = ([tensors[k] for k in first.input_keys], [tensors[k] for k in second.input_keys])
        return outs, args

    def prepared(self, tensors: Mapping[Key, torch.Tensor]) -> KernelLaunch | None:
        """The fused launch over ``tensors`` as the fusion says it (``Fusion.launch_of``),
        live only while the fusion stays :meth:`active`; None where it cannot be said."""
        launch_of = self.fusion.launch_of
        if launch_of is None or not self.active():
            return None
        outs, args = self._operands(tensors)
        launch = launch_of(outs, args, (self.first.params, self.second.params))
        if launch is None:
            return None
        own = launch.live
        return replace(launch, live=lambda: self.active() and own())

    def run(self, tensors: Mapping[Key, torch.Tensor], *, static: bool) -> None:
        first, second, fusion = self.first, self.second, self.fusion
        if not self.active():
            self._one_by_one(tensors, static)
            return
        outs, args = self._operands(tensors)
        try:
            fusion.fn(outs, args, (first.params, second.params))
        except PlanError:
            raise
        except Exception as exc:
            self.retired.add(fusion.ops)
            warn_once(
                f"{first.key} + {second.key}: the fused {fusion.provider!r} launch failed "
                f"({type(exc).__name__}: {exc}); running the two steps one by one from now on"
            )
            self._one_by_one(tensors, static)

    def _one_by_one(self, tensors: Mapping[Key, torch.Tensor], static: bool) -> None:
        """Each step through its own chain (which may fall back on its own)."""
        self.first.run(tensors, static=static)
        self.second.run(tensors, static=static)


Runnable = Step | FusedSteps


def fuse_steps(
    steps: Iterable[Step], retired: set[tuple[str, str]] | None = None
) -> tuple[Runnable, ...]:
    """``steps`` in order, each adjacent pair with a registered fusion joined into one;
    ``retired`` is the planner's set of fusions that failed (see ``FusedSteps.retired``)."""
    retired = set() if retired is None else retired
    steps = list(steps)
    out: list[Runnable] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        fusion = _FUSIONS.get((step.op_name, nxt.op_name)) if nxt is not None else None
        # a producer and its consumer: the second reads the first's output first
        if fusion is not None and nxt.input_keys[:1] == (step.output,):
            out.append(FusedSteps(step, nxt, fusion, retired))
            i += 2
        else:
            out.append(step)
            i += 1
    return tuple(out)
