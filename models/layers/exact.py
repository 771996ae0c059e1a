"""Contractions that give the same bits for a row whatever else is in the batch (on the CPU).

A CPU matmul rounds a row differently when the batch has 1 row or 50: the
blocking changes with the shape. That last-bit drift would be harmless, but
the indexer quantises its queries to fp8 and keeps a top-k: one flipped fp8
rounding selects another KV token, and a prompt fed in chunks then decodes
differently from the same prompt fed token by token. The invariants the tests
hold (chunked prefill equals token-by-token decode; speculative greedy equals
plain greedy) are exact, so on the CPU every contraction of the reference
model accumulates in float64 and rounds once: the result is the correctly
rounded value up to float64 noise, the same bits for any batch shape.

On a GPU the model runs its production dtype with the usual kernels; there
these are plain ``nn.Linear`` / ``torch.einsum``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def exact(t: torch.Tensor) -> bool:
    """Whether computations on ``t`` take the batch-invariant float64 path (the CPU)."""
    return t.device.type == "cpu"


def accumulate_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 on the CPU (batch invariance), float32 elsewhere: the dtype to accumulate in."""
    return torch.float64 if exact(t) else torch.float32


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU result does not depend on the batch's row count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not exact(x):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), bias).to(x.dtype)


def contract(equation: str, *operands: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.einsum`` in float64 on the CPU, in the operands' own dtype elsewhere; in ``dtype``."""
    if exact(operands[0]):
        operands = tuple(op.double() for op in operands)
    else:  # one dtype for all, the widest given (an fp32 routing matrix over bf16 outputs)
        wide = functools.reduce(torch.promote_types, (op.dtype for op in operands))
        operands = tuple(op.to(wide) for op in operands)
    return torch.einsum(equation, *operands).to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` rounded once from float64 on the CPU: vectorised and scalar float32 paths
    disagree in the last bit, and which one a row gets depends on the batch's shape."""
    return F.silu(x.double()).to(x.dtype) if exact(x) else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` rounded once from float64 on the CPU (see :func:`silu`)."""
    return torch.sigmoid(x.double()).to(x.dtype) if exact(x) else torch.sigmoid(x)
