"""The residual stream's add and the next sub-layer's RMSNorm, as one step.

A decoder layer adds the attention output to the stream and normalises the sum for the
FFN, then adds the FFN output and normalises for the next layer's attention: two add
kernels and two norm kernels a layer. On CUDA each pair is one Triton launch
(``add_rms_norm_triton``), bit-equal to the pair it replaces; 61 layers drop 122
launches a step, and with them the idle gap a CUDA graph still leaves between kernels.
The CPU keeps the plain add followed by ``RMSNorm`` (its float64 norm bits are what the
CPU model's exactness tests pin).
"""

from __future__ import annotations

import torch

from dsv32_engine.models.layers.norm import RMSNorm
from dsv32_engine.models.layers.norm_triton import add_rms_norm_triton


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, norm(h + delta))``: the updated stream and its normalised copy."""
    if norm.takes_kernel(h) and delta.dtype == h.dtype and delta.shape == h.shape:
        return add_rms_norm_triton(h, delta, norm.weight, norm.eps)
    total = h + delta
    return total, norm(total)
