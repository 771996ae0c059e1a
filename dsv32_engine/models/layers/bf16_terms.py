"""An fp32 projection run on bf16 tensor cores without losing its fp32 weights.

The indexer's head weights (``weights_proj``, ``[64, 7168]``) are fp32 in the reference
model: they multiply every relu'd dot product in the top-k ranking. On the H200 cuBLAS
runs that fp32 GEMM at decode sizes as a SIMT kernel plus a split-K reduction, with a cast
of the activations before it and the scale after: four launches and ~15 us a layer.

Here the weight is split once into three bf16 terms, ``w = t1 + t2 + t3`` (each the bf16
rounding of what the previous ones left: 3 x 8 significant bits, so every fp32 weight of
normal range is represented exactly), stacked as one ``[3N, K]`` bf16 matrix. The
activations are bf16 already (the fp32 cast of ``x`` was exact), so each product
``x_k * t_ik`` is exact, and one bf16 GEMM with fp32 output
(``torch.mm(..., out_dtype=float32)``) gives the three partial sums, added after. The
tensor cores' fp32 accumulation is not quite IEEE fp32: measured on the H200 against
float64 (``python -m benchmarks weights_proj_gemm``, outputs of standard deviation ~0.02), the
largest error was 0.7-1.5e-7, against 0.6-3.4e-8 for cuBLAS's fp32 GEMM and 0.7-1.2e-4
with the weight rounded to bf16 once. The ranking reads these weights through
fp8-quantised queries and keys (steps of 2**-4), far coarser than either. At one row the fp32 SIMT
kernel is faster (7.7 against 9.2 us), from 16 rows it is not (15.1-19.2 against
9.5-10.3 us at 16-128 rows), so ``MIN_ROWS`` picks per batch shape.

The terms are derived state, remade whenever the source weight is replaced or written in
place (its version counter moves: ``load``, ``copy_`` under ``no_grad``); a write through
``.data`` bypasses version counting, as it bypasses autograd, and is not seen.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from planner.errors import GraphSafetyError

MIN_ROWS = 16
"""Rows from which the bf16-terms GEMM beat the fp32 one on the H200 (measured at 1, 16,
64 and 128 rows; the crossover between 1 and 16 is not measured)."""


def bf16_terms(weight: torch.Tensor) -> torch.Tensor:
    """``[3N, K]`` bf16: three row blocks whose fp32 sum is ``weight`` (fp32 ``[N, K]``)."""
    w = weight.detach().float()
    first = w.to(torch.bfloat16)
    rest = w - first.float()
    second = rest.to(torch.bfloat16)
    third = (rest - second.float()).to(torch.bfloat16)
    return torch.cat([first, second, third], dim=0)


@functools.cache
def mm_fp32_out_available(device: torch.device) -> bool:
    """Whether this torch has the bf16-in, fp32-out GEMM on ``device`` (CUDA, torch >= 2.8);
    probed once per device by trying it (torch raises NotImplementedError for a backend
    without the kernel, TypeError where ``out_dtype`` is unknown)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.zeros(1, 16, dtype=torch.bfloat16, device=device)
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


class Bf16TermsProjection:
    """``x @ linear.weight.T`` for bf16 ``x`` and an fp32, bias-free ``linear``, in fp32,
    as one bf16 GEMM over the weight's three bf16 terms; see the module docstring."""

    def __init__(self, linear: nn.Linear) -> None:
        if linear.bias is not None or linear.weight.dtype != torch.float32:
            raise ValueError("only a bias-free fp32 Linear is split into bf16 terms")
        self.linear = linear
        self.out = linear.out_features
        self._stamp: tuple[int, int] | None = None
        self._terms: torch.Tensor | None = None

    def _current(self) -> torch.Tensor:
        weight = self.linear.weight
        stamp = (weight.data_ptr(), weight._version)
        if stamp != self._stamp or self._terms is None:
            if weight.is_cuda and torch.cuda.is_current_stream_capturing():
                # Made in a capture, the terms would be a graph's output, computed only when
                # it replays and read unwritten by every other forward before that.
                raise GraphSafetyError(
                    "refused under graph capture: the indexer's bf16 weight terms would be "
                    "made inside it; run this layer eagerly (a graph's warm-up) first",
                    field="weights_proj",
                )
            self._terms = bf16_terms(weight).t()  # [K, 3N], a view: cuBLAS takes it transposed
            self._stamp = stamp
        return self._terms

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[..., N]`` for bf16 ``x [..., K]``."""
        rows = x.reshape(-1, x.shape[-1])
        partial = torch.mm(rows, self._current(), out_dtype=torch.float32)
        total = partial.view(rows.shape[0], 3, self.out).sum(dim=1)
        return total.view(*x.shape[:-1], self.out)
