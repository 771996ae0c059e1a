"""Deterministic random weights for the decoder and its MTP draft layer.

One rule set for both, so a draft built beside a target has weights of the same
scales, and both are reproducible per seed and device type.
"""

from __future__ import annotations

import torch
from torch import nn

OUTPUT_PROJECTIONS = ("wo", "w2")
"""Projections that write into the residual stream: scaled down by depth."""


@torch.no_grad()
def random_init(module: nn.Module, seed: int, depth: int) -> None:
    """Fill ``module``'s parameters in registration order from ``seed``.

    Projections: N(0, 1/fan_in) so each keeps unit scale; projections that
    write into the residual stream are further divided by sqrt(2 * depth) so
    the stream grows by O(1) overall; norms start at 1/0; the gate bias is
    small but non-zero so it does shift expert choice. On the ``meta`` device there is
    nothing to fill (a module built there is only measured: ``serving.memory_fit``).
    """
    device = next(module.parameters()).device
    if device.type == "meta":
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    out_scale = (2 * depth) ** -0.5
    for name, p in module.named_parameters():
        parts = name.split(".")
        owner = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        if owner.endswith("norm"):
            p.fill_(1.0 if parts[-1] == "weight" else 0.0)
        elif owner == "gate" and parts[-1] == "bias":
            p.normal_(0.0, 0.05, generator=gen)
        elif owner == "embed":
            p.normal_(0.0, 1.0, generator=gen)
        else:
            std = p.shape[-1] ** -0.5
            if owner in OUTPUT_PROJECTIONS:
                std *= out_scale
            p.normal_(0.0, std, generator=gen)
