"""Host ops' small outputs, kept in the staging buffer's appendix so the staging copy sends them.

Why: a host op (FlashInfer's plan) writes a few integers of its own into the plan, a
summary of what it planned. Sent by itself, that is a second host-to-device copy per
replay: 7.9 us of host time on the H200's host (r10-3), the price of any copy there. A
capture's static output of a host op, of fixed shape and a few bytes, therefore lives
in the static stager's device buffer, after the staged inputs (the appendix). On the
replay lane the host op writes it into the pinned host buffer before the one copy; on
every other path it writes the device tensor after the staging copy, as before, so the
stale bytes that copy brought are overwritten in stream order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from planner.dims import parse_dim
from planner.program import Key, Program

_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
_MOST_BYTES = 256
"""Outputs larger than this are not a summary: they keep their own buffer and copy."""


@dataclass(frozen=True)
class StagedOutput:
    """Where one host op's output lives in the appendix: its offset in int32 elements from
    the appendix's start, its dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def words(self) -> int:
        """int32 elements it takes."""
        return math.prod(self.shape) * self.dtype.itemsize // 4

    def device_view(self, device_buf: torch.Tensor, appendix_at: int) -> torch.Tensor:
        start = appendix_at + self.offset
        return device_buf[start : start + self.words].view(self.dtype).view(self.shape)

    def host_view(self, host_view: np.ndarray, appendix_at: int) -> np.ndarray:
        start = appendix_at + self.offset
        return host_view[start : start + self.words].view(_DTYPES[self.dtype]).reshape(self.shape)


def staged_outputs(program: Program) -> dict[Key, StagedOutput]:
    """The program's host-op outputs that can live in the appendix: a host op's (its provider
    not graph-safe: it always runs on the host), of a shape without dimensions, int32 or
    int64, a few bytes. Each 8-byte aligned, in program order."""
    out: dict[Key, StagedOutput] = {}
    at = 0
    for step in program.steps:
        spec = step.spec
        if step.in_graph or step.chain.current.graph_safe or spec.dtype not in _DTYPES:
            continue
        dims = [parse_dim(expr) for expr in spec.shape]
        if any(name is not None for name, _ in dims):
            continue
        shape = tuple(offset for _, offset in dims)
        if math.prod(shape) * spec.dtype.itemsize > _MOST_BYTES:
            continue
        at += at & 1  # 8-byte aligned (the appendix itself starts so)
        out[step.output] = StagedOutput(at, spec.dtype, shape)
        at += out[step.output].words
    return out


def appendix_words(outputs: dict[Key, StagedOutput]) -> int:
    """int32 elements the appendix needs for ``outputs``."""
    return max((o.offset + o.words for o in outputs.values()), default=0)
