"""Normalisations computed in fp32 whatever the activation dtype.

The reference model keeps norm weights in fp32 and normalises in fp32 (in
float64 on the CPU, see ``exact``); a bf16 mean of squares over 7168 features
loses enough precision to move top-k choices downstream, so the cast happens
here, once, for every caller.

On CUDA, ``RMSNorm`` is one Triton launch (``norm_triton``) instead of the seven or so
kernels of the torch formula: it runs four times a layer, and in a decode step those
launches, not the bytes they move, were its cost. ``LayerNorm`` likewise is one launch
(``layer_norm_triton``) instead of three, and takes the indexer key's rope into that
launch when asked. The CPU keeps the torch formulas, whose float64 bits the CPU model's
exactness tests depend on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv32_engine.models.layers.exact import accumulate_dtype, forward_takes_kernel
from dsv32_engine.models.layers.layer_norm_triton import layer_norm_rope_triton, layer_norm_triton
from dsv32_engine.models.layers.norm_triton import rms_norm_triton
from dsv32_engine.models.layers.rope import apply_rope_half_leading


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula: what ``RMSNorm`` computes off CUDA, and what the Triton kernel
    is tested against (float64 on the CPU, fp32 elsewhere, see ``accumulate_dtype``)."""
    acc = accumulate_dtype(x)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(acc)).to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """The torch formula: ``LayerNorm`` off CUDA (float64 on the CPU, see
    ``accumulate_dtype``) and the GPU kernel's reference (fp32)."""
    acc = accumulate_dtype(x)
    y = F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), bias.to(acc), eps)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is normalised by the Triton kernel rather than the torch formula
        (``forward_takes_kernel``)."""
        return forward_takes_kernel(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_kernel(x):
            return rms_norm_triton(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """Mean/variance norm with weight and bias (the indexer key norm), in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """As ``RMSNorm.takes_kernel`` (``forward_takes_kernel``)."""
        return forward_takes_kernel(x, self.weight, self.bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int] | None = None
    ) -> torch.Tensor:
        """The norm, then, with ``rope = (cos, sin, rope_dim)``, ``apply_rope_half_leading``
        on it: on CUDA both in one launch, which is why the rope is an argument here rather
        than the caller's next call. Through ``__call__`` so module hooks (the profiler's
        per-module ranges) still see the fused launch as this module's."""
        if self.takes_kernel(x):
            if rope is None:
                return layer_norm_triton(x, self.weight, self.bias, self.eps)
            return layer_norm_rope_triton(x, self.weight, self.bias, self.eps, *rope)
        y = layer_norm_reference(x, self.weight, self.bias, self.eps)
        return y if rope is None else apply_rope_half_leading(y, *rope)
