"""YaRN rotary embeddings in the two pair layouts DeepSeek-V3.2 uses.

MLA rotates interleaved pairs ``(x[2i], x[2i+1])``; the indexer rotates
half-split pairs ``(x[i], x[i+d/2])``. Both use the same YaRN frequencies;
mixing the layouts up silently degrades the indexer's top-k, which is why the
two functions exist side by side and are tested against one complex formula.

``cos``/``sin`` are computed from the plan's positions in fp32, once per
forward, for all layers.
"""

from __future__ import annotations

import math

import torch

from models.config import YarnScaling, yarn_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """Rope dimension whose wavelength fits ``num_rotations`` times in ``max_pos``."""
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(
    dim: int, theta: float, scaling: YarnScaling | None, max_position: int
) -> torch.Tensor:
    """Per-pair inverse frequencies ``[dim/2]`` fp32, YaRN-blended when extended.

    High-frequency pairs (more than ``beta_fast`` turns over the original
    length) keep their frequency, low-frequency ones (fewer than
    ``beta_slow``) are divided by ``factor``, and a linear ramp blends between.
    Scaling applies only when ``max_position`` exceeds the original length.
    """
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None or max_position <= scaling.original_max_position_embeddings:
        return inv
    orig = scaling.original_max_position_embeddings
    low = max(math.floor(_correction_dim(scaling.beta_fast, dim, theta, orig)), 0)
    high = min(math.ceil(_correction_dim(scaling.beta_slow, dim, theta, orig)), dim - 1)
    span = (high - low) if high > low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1.0 - ramp  # 1: keep original frequency, 0: interpolate fully
    return inv / scaling.factor * (1 - keep) + inv * keep


def yarn_attention_factor(scaling: YarnScaling | None) -> float:
    """Magnitude factor on cos/sin: mscale(m) / mscale(m_all); 1.0 for DeepSeek-V3.2."""
    if scaling is None:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
        scaling.factor, scaling.mscale_all_dim
    )


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [rows, dim/2]`` fp32 for integer ``positions [rows]``."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    if positions.device.type == "cpu":  # rounded once from float64: batch-invariant (see exact)
        wide = angles.double()
        return (wide.cos() * attention_factor).float(), (wide.sin() * attention_factor).float()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def _broadcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[rows, d/2]`` -> ``[rows, 1, ..., d/2]`` to match ``x [rows, ..., d]``."""
    return t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1])


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` (MLA layout); fp32 math, input dtype out."""
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i+d/2])`` (indexer layout); fp32 math, input dtype out."""
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1).to(x.dtype)
