"""What a planner hands to layers and reports: the plans of one batch, and its counters.

``build_plans`` makes a batch's plans with ``model_construct``: the planner made every
tensor itself, to its spec, so validating them again per batch would only cost host time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.batch import ForwardMode, step_key
from planner.errors import PlanWriteError, SchemaError
from planner.program import Key, Program, Step
from planner.schema import Plan


class PlanSet(Mapping[str, Plan]):
    """The frozen plans of one batch, by backend name, with how they were made.

    A stepped batch (draft decode) has one plan set per step in ``steps``;
    layers of step ``s`` read ``plans.step(s)``. As a mapping it then holds
    every step's plans under ``backend@s`` (what diffs, digests and dumps walk),
    so no code can read one step's plan believing it is the batch's. ``tokens`` is the token
    bucket of a ragged plan set padded to static shapes (captured, or ``plan(pad_tokens=)``),
    else None.
    """

    __slots__ = ("_plans", "phase", "mode", "reqs", "real_reqs", "steps", "tokens")

    def __init__(
        self,
        plans: dict[str, Plan],
        phase: str,
        mode: ForwardMode,
        reqs: int,
        real_reqs: int,
        steps: Sequence[PlanSet] = (),
        tokens: int | None = None,
    ):
        self._plans = plans
        self.tokens = tokens
        self.phase = phase
        self.mode = mode
        self.reqs = reqs
        self.real_reqs = real_reqs
        self.steps = tuple(steps)

    @classmethod
    def stepped(
        cls, steps: Sequence[PlanSet], phase: str, mode: ForwardMode, reqs: int, real_reqs: int
    ) -> PlanSet:
        """The plan set of a stepped batch over its steps' plan sets."""
        flat = {step_key(b, s): p for s, step in enumerate(steps) for b, p in step.items()}
        out = cls(flat, phase, mode, reqs, real_reqs, steps)
        out.mark(phase, mode, real_reqs)
        return out

    def step(self, s: int) -> PlanSet:
        """The plans step ``s`` of a stepped batch reads."""
        if not 0 <= s < len(self.steps):
            raise SchemaError(
                "no such step in this plan set",
                field="step",
                expected=f"0..{len(self.steps) - 1}" if self.steps else "a stepped plan set",
                actual=s,
            )
        return self.steps[s]

    def mark(self, phase: str, mode: ForwardMode, real_reqs: int) -> None:
        """Say how (and for how many requests) these plans were last made, steps included."""
        for plans in (self, *self.steps):
            plans.phase, plans.mode, plans.real_reqs = phase, mode, real_reqs

    def __getitem__(self, backend: str) -> Plan:
        try:
            return self._plans[backend]
        except KeyError:
            hint = " (a stepped plan set: read plans.step(s))" if self.steps else ""
            raise SchemaError(
                "no plan for backend" + hint, field=backend, expected=sorted(self._plans)
            ) from None

    def __setitem__(self, backend: str, plan: object) -> None:
        raise PlanWriteError("a plan set is read-only: layers may only read it", field=backend)

    def __delitem__(self, backend: str) -> None:
        raise PlanWriteError("a plan set is read-only: layers may only read it", field=backend)

    def get(self, backend: str, default: Plan | None = None) -> Plan | None:
        """The backend's plan, or ``default`` when this batch has none (a companion plan
        that only some modes make): ``Mapping.get``'s contract, which ``[]``'s error breaks."""
        return self._plans.get(backend, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        steps = f", {len(self.steps)} steps" if self.steps else ""
        return (
            f"PlanSet({self.phase}, {self.mode.value}, reqs={self.reqs}/{self.real_reqs}"
            f"{'' if self.tokens is None else f', tokens={self.tokens}'}{steps}, "
            f"{sorted(self._plans)})"
        )


@dataclass
class PlannerStats:
    """What the planner did: batches per phase, op executions, host time.

    The hot path only counts how often each program ran (one increment per
    batch); per-op and per-field counts are derived when read. Programs are keyed by mode,
    an idle batch of a shape other than decode's by ``(idle, shape)`` (it ran that shape's
    program, and an idle rank changes shape from step to step).
    """

    batches: Counter = field(default_factory=Counter)
    host_seconds: Counter = field(default_factory=Counter)
    verified: int = 0
    """Debug mode: replays compared bit for bit with a fresh eager plan (:meth:`Planner.verify`)."""
    write_checks: int = 0
    """Debug mode: forwards whose plans were digested before and after (:meth:`Planner.guard`)."""
    program_runs: Counter = field(default_factory=Counter)
    programs: dict = field(default_factory=dict)

    def count(
        self, phase: str, mode: ForwardMode, steps: Sequence[Step], spent: float, shape: ForwardMode
    ) -> None:
        """One batch of ``mode`` made in ``phase`` (``eager`` or ``replay``) by ``shape``'s
        program (an idle batch's shape, else the mode): the ``steps`` it ran (a stepped
        batch's, once per step), the host seconds ``spent``; eager ones also per mode."""
        key = mode if shape is mode or shape is ForwardMode.DECODE else (mode, shape)
        self.program_runs[key] += 1
        self.programs[key] = steps
        self.batches[phase] += 1
        self.host_seconds[phase] += spent
        if phase == "eager":
            per_mode = f"eager_{mode.value}"
            self.batches[per_mode] += 1
            self.host_seconds[per_mode] += spent

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
                for key in step.keys:
                    out[key] += runs
        return out

    def op_calls_per_batch(
        self, mode: ForwardMode | tuple[ForwardMode, ForwardMode]
    ) -> dict[str, float]:
        """Executions per op name per batch of ``mode`` (or ``(idle, shape)``), whatever the
        number of layers."""
        runs = self.program_runs.get(mode, 0)
        if not runs:
            return {}
        out: Counter = Counter()
        for step in self.programs[mode]:
            out[step.op_name] += 1
        return dict(sorted(out.items()))

    def reset(self) -> None:
        self.__init__()


def build_plans(
    program: Program,
    tensors: Mapping[Key, Any],
    handles: Mapping[Key, Any],
    dims: Mapping[str, int],
) -> dict[str, Plan]:
    """Frozen plans over ``tensors``; scalars from the dimensions or the backend's settings
    (a backend's own value: two backends may define one setting differently).

    Each tensor of a plan is its own tensor over the planner's memory (``Tensor.data``: same
    storage, offset, shape and strides, a version counter of its own), not the view the
    storage cut: views of one buffer share one counter, so a layer's in-place write into a
    field would count against every field of the buffer and ``graphs.plan_writes`` could not
    name the one written. Fields that are one tensor (a shared computation, an alias) stay
    one. About 0.8 us a field on the CPU."""
    plans = {}
    own: dict[int, torch.Tensor] = {}
    for backend, cls in program.schemas.items():
        settings = program.backend_settings[backend]
        values: dict[str, Any] = {}
        for name in cls.tensor_specs:
            tensor = tensors[(backend, name)]
            mine = own.get(id(tensor))
            if mine is None:
                mine = own[id(tensor)] = tensor.data
            values[name] = mine
        for name, spec in cls.handle_specs.items():
            values[name] = handles.get((backend, spec.of))
        for name, spec in cls.scalar_specs.items():
            if spec.value in dims:
                values[name] = dims[spec.value]
            elif spec.value in settings:
                values[name] = settings[spec.value]
            else:
                raise SchemaError(
                    f"scalar refers to unknown value {spec.value!r}", field=f"{backend}.{name}"
                )
        plans[backend] = cls.model_construct(**values)
    return plans
