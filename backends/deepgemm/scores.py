"""The indexer score both logits references compute, one way, so they agree bit for bit.

``score = k_scale * sum_h w_h * relu(q_h . k)``. The fp8 dot products are exact
in float64 (4-bit mantissas, 128 terms: no rounding, whatever the summation
order), and the weighted head sum is element-wise in a fixed head order, so
the paged (decode) and ragged (prefill) references give the same fp32 score
for the same query and key: a prompt fed in chunks selects the same top-k as
the same prompt fed token by token.
"""

from __future__ import annotations

import torch


def weighted_head_sum(dots: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """``sum_h w[r, h] * relu(dots[r, h, c])`` in float64, heads in order; ``dots [R, H, C]``.

    Element-wise ops only (no reduction kernel), so the rounding order is fixed by the
    spec rather than by a reduction's vectorisation: the same bits on every device.
    ``dots`` is overwritten.
    """
    dots.clamp_(min=0).mul_(w64.unsqueeze(-1))
    acc = dots[:, 0].clone()
    for h in range(1, dots.shape[1]):
        acc += dots[:, h]
    return acc
