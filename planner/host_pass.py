"""Eager plans compute on the host what needs no device data, inside the staging buffer.

An eager plan is fresh tensors for one batch. Most of its fields are small
per-request or per-token arithmetic (lengths, prefix sums, offsets, clamps,
schedules) over inputs that start on the host; on a GPU, launching a kernel
for each costs tens of microseconds of host time, far more than the arithmetic. An op's
host twin (``numpy``, see :meth:`planner.ops.MetadataOp.host_twin`) computes
the same values on the host, straight into the staging buffer after the
inputs, so the one host-to-device copy the inputs needed carries the results
too (the way engines build per-batch metadata on the CPU and ship it once).
Only ops that read device data (the token table) launch.

Captured plans never use it: their ops run inside the graph, where a launch
costs no host time. Replay compared with a fresh plan (debug mode) thus also
checks each twin against the device provider, on every batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from planner.errors import warn_once
from planner.ops import ProviderFn
from planner.program import Key, Program, Step
from planner.schema import resolve_shape
from planner.staging import Segment

ALIGN = 64
"""Outputs start on 256-byte boundaries (64 int32), as a separate allocation would."""


class HostPassFailed(Exception):
    """A host twin raised: the plan is redone with every op on the device."""


@dataclass
class Switch:
    """One per planner: a twin failing in any mode or size turns the host pass off for all."""

    on: bool = True


@dataclass(frozen=True)
class Placement:
    """Where one host-computed output lives in the staging buffer."""

    key: Key
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class HostPass:
    """The steps of one program that an eager plan runs on the host, in program order.

    A step qualifies when its op has a host twin, it was not forced onto a
    provider, it is a device op (a host op returning a handle already runs
    on the host), its outputs are int32 like the staging buffer, and every
    input is a staged source or an earlier host step's output.
    """

    def __init__(self, program: Program, segments: Mapping[Key, Segment], switch: Switch) -> None:
        self.segments = segments
        self.switch = switch
        chosen: list[tuple[Step, ProviderFn]] = []
        reads: list[tuple[Segment | int, ...]] = []
        produced: dict[Key, int] = {}
        for step in program.steps:
            twin = step.chain.op.host
            if (
                twin is not None
                and step.chain.forced is None
                and step.chain.current.graph_safe
                and all(spec.dtype == torch.int32 for spec in step.specs)
                and all(key in segments or key in produced for key in step.input_keys)
            ):
                # Each input: a staged segment, or the index of an earlier host output.
                reads.append(tuple(segments.get(key, produced.get(key)) for key in step.input_keys))
                for key in step.outputs:
                    produced[key] = len(produced)
                chosen.append((step, twin.fn))
        self.steps = tuple(chosen)
        self._reads = tuple(reads)
        self.outputs = frozenset(produced)

    @property
    def failed(self) -> bool:
        return not self.switch.on

    def placements(self, base: int, dims: Mapping[str, int]) -> tuple[tuple[Placement, ...], int]:
        """Each output's place after ``base`` elements of inputs (every step's outputs in
        order), and the elements in all."""
        out, offset = [], base
        for step, _ in self.steps:
            for key, spec in zip(step.outputs, step.specs):
                offset = -(-offset // ALIGN) * ALIGN
                shape = resolve_shape(spec.shape, dims, field=f"{key[0]}.{key[1]}")
                out.append(Placement(key, offset, shape))
                offset += math.prod(shape)
        return tuple(out), offset

    def run(
        self, host: np.ndarray, placements: tuple[Placement, ...], reqs: int, tokens: int
    ) -> None:
        """Every host step, reading staged inputs and earlier outputs from ``host``."""
        outs = [host[p.offset : p.offset + p.numel].reshape(p.shape) for p in placements]
        first = 0
        for (step, fn), reads in zip(self.steps, self._reads):
            args = [
                outs[r]
                if isinstance(r, int)
                else host[r.offset : r.offset + (tokens if r.per_token else reqs)]
                for r in reads
            ]
            mine = outs[first : first + len(step.outputs)]
            first += len(step.outputs)
            try:
                fn(*mine, *args, **step.params)
            except Exception as exc:
                self.switch.on = False
                warn_once(
                    f"{step.op_name}: host twin failed ({type(exc).__name__}: {exc}); "
                    "eager plans compute every field on the device from now on"
                )
                raise HostPassFailed(step.key) from exc


def host_pass_for(
    program: Program, segments: Mapping[Key, Segment], switch: Switch
) -> HostPass | None:
    """The program's host pass, or None when no step qualifies."""
    host_pass = HostPass(program, segments, switch)
    return host_pass if host_pass.steps else None
