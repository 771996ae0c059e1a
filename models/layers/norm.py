"""Normalisations computed in fp32 whatever the activation dtype.

The reference model keeps norm weights in fp32 and normalises in fp32 (in
float64 on the CPU, see ``exact``); a bf16 mean of squares over 7168 features
loses enough precision to move top-k choices downstream, so the cast happens
here, once, for every caller.

On CUDA, ``RMSNorm`` is one Triton launch (``norm_triton``) instead of the seven or so
kernels of the torch formula: it runs four times a layer, and in a decode step those
launches, not the bytes they move, were its cost. The CPU keeps the torch formula, whose
float64 bits the CPU model's exactness tests depend on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.triton_kernels import triton_available
from models.layers.exact import accumulate_dtype
from models.layers.norm_triton import rms_norm_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula: what ``RMSNorm`` computes off CUDA, and what the Triton kernel
    is tested against (float64 on the CPU, fp32 elsewhere, see ``accumulate_dtype``)."""
    acc = accumulate_dtype(x)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(acc)).to(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel has no backward: where autograd would record the norm, the torch
        # formula runs instead (the serving model has no parameter that needs a gradient).
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.is_cuda and not needs_grad and triton_available(x.device):
            return rms_norm_triton(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """Mean/variance norm with weight and bias (the indexer key norm), in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = accumulate_dtype(x)
        y = F.layer_norm(
            x.to(acc), (x.shape[-1],), self.weight.to(acc), self.bias.to(acc), self.eps
        )
        return y.to(x.dtype)
