"""YaRN rotary embeddings in the two pair layouts DeepSeek-V3.2 uses.

MLA rotates interleaved pairs ``(x[2i], x[2i+1])``; the indexer rotates
half-split pairs ``(x[i], x[i+d/2])``. Both use the same YaRN frequencies;
mixing the layouts up silently degrades the indexer's top-k, which is why the
two functions exist side by side and are tested against one complex formula.

``cos``/``sin`` are computed from the plan's positions in fp32, once per
forward, for all layers.

On CUDA each rotation is one Triton launch (``rope_triton``) rather than the 8-10
elementwise kernels of the torch formula, with the same fp32 operations and one rounding;
elsewhere the torch formula runs unchanged.
"""

from __future__ import annotations

import math

import torch

from dsv32_engine.models.config import YarnScaling, yarn_mscale
from dsv32_engine.models.layers.exact import forward_takes_kernel
from dsv32_engine.models.layers.rope_triton import rope_half_leading_triton, rope_interleaved_triton


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


def _use_triton(x: torch.Tensor) -> bool:
    """One launch instead of 8-10 on CUDA. CPU stays on the torch formula (the CPU model's
    exactness tests pin it); so does anything that needs autograd, which the kernels lack."""
    return forward_takes_kernel(x)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` (MLA layout); fp32 math, input dtype out."""
    if _use_triton(x):
        return rope_interleaved_triton(x, cos, sin)
    return apply_rope_interleaved_torch(x, cos, sin)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i+d/2])`` (indexer layout); fp32 math, input dtype out."""
    if _use_triton(x):
        return rope_half_leading_triton(x, cos, sin, x.shape[-1])
    return apply_rope_half_torch(x, cos, sin)


def apply_rope_half_leading(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Half-split rope on the leading ``rope_dim`` features, the rest passed through: the
    indexer's layout, where the split + cat around the rope would be two more launches."""
    if _use_triton(x):
        return rope_half_leading_triton(x, cos, sin, rope_dim)
    return apply_rope_half_leading_torch(x, cos, sin, rope_dim)


# The torch formulas: the CPU path, and the references the kernels are tested against.


def apply_rope_interleaved_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``apply_rope_interleaved`` in plain torch ops."""
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_half_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_half`` in plain torch ops."""
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1).to(x.dtype)


def apply_rope_half_leading_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """``apply_rope_half_leading`` in plain torch ops."""
    pe, nope = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
    return torch.cat([apply_rope_half_torch(pe, cos, sin), nope], dim=-1)
