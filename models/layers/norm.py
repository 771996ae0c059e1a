"""Normalisations computed in fp32 whatever the activation dtype.

The reference model keeps norm weights in fp32 and normalises in fp32 (in
float64 on the CPU, see ``exact``); a bf16 mean of squares over 7168 features
loses enough precision to move top-k choices downstream, so the cast happens
here, once, for every caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.exact import accumulate_dtype


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = accumulate_dtype(x)
        xf = x.to(acc)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(acc)).to(x.dtype)


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
