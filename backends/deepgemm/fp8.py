"""FP8 e4m3 quantisation and deep_gemm's paged index-key cache layout.

Quantisation is DeepSeek-V3.2's indexer recipe: per 128-element vector,
``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` (a power of two, so dividing by it is exact)
and ``value = clamp(x / s, -448, 448)`` rounded to float8_e4m3fn. On CUDA it runs as one
Triton launch (``fp8_triton``), bit-identical to the torch ops kept here for the CPU.

The index cache is ``uint8 [num_blocks, 64, 1, D + 4]`` as deep_gemm's
``fp8_paged_mqa_logits`` takes it, but the 4-D shape is only a byte count: deep_gemm reads
each block (``stride(0)`` bytes) as ``64 * D`` fp8 bytes, token-major (token ``t`` at
``t * D``), followed by 64 float32 scales (token ``t``'s at byte ``64 * D + 4 * t``). So
"row" ``t`` of the 4-D view does NOT hold token ``t``; always go through the helpers here.
Token slot ``n`` lives in block ``n // 64`` at offset ``n % 64``.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from backends.deepgemm.fp8_triton import (
    KERNEL_DTYPES,
    quantize_fp8_to_cache_triton,
    quantize_fp8_triton,
)
from planner.errors import PlanError

__all__ = [
    "FP8_MAX",
    "QUANT_BLOCK",
    "PAGE",
    "quantize_fp8_e4m3_per_vector",
    "quantize_fp8_e4m3_per_vector_reference",
    "dequantize_fp8_per_vector",
    "quantize_query",
    "new_index_cache",
    "gather_index_cache",
    "index_cache_views",
    "write_index_cache",
    "quantize_into_index_cache",
    "pack_index_kv_cache",
    "unpack_index_kv_cache",
]

FP8_MAX = 448.0
QUANT_BLOCK = 128
PAGE = 64
_AMAX_FLOOR = 1e-4


def _pow2_ceil_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(max(amax, 1e-4) / 448))`` exactly, via frexp (no log2 rounding)."""
    ratio = torch.clamp(amax.float(), min=_AMAX_FLOOR) / FP8_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(ratio), exponent)


def _check_vectors(x: torch.Tensor, block: int) -> None:
    if not x.is_floating_point():
        raise PlanError("must be floating point", field="x", expected="float", actual=x.dtype)
    d = x.shape[-1]
    if d % block != 0:
        raise PlanError(
            "last dim must be a multiple of the block",
            field="x",
            expected=f"k * {block}",
            actual=d,
        )


def quantize_fp8_e4m3_per_vector(
    x: torch.Tensor, block: int = QUANT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` per ``block``-element vector of the last dim.

    Returns ``(x_fp8 [..., D] float8_e4m3fn, scale [..., D // block] float32)`` with
    ``x ~= x_fp8.float() * scale`` (each scale repeated over its block).

    On CUDA this is one Triton launch (``fp8_triton``), bit-identical to the torch recipe
    (:func:`quantize_fp8_e4m3_per_vector_reference`), which is about ten launches and ran
    twice a layer in the indexer; the CPU keeps the torch recipe.
    """
    _check_vectors(x, block)
    if x.is_cuda and x.dtype in KERNEL_DTYPES and triton_available(x.device):
        return quantize_fp8_triton(x, block)
    return _quantize_torch(x, block)


def quantize_fp8_e4m3_per_vector_reference(
    x: torch.Tensor, block: int = QUANT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_e4m3_per_vector` in torch ops on any device: the definition the
    kernel is tested against."""
    _check_vectors(x, block)
    return _quantize_torch(x, block)


def _quantize_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], d // block, block)
    scale = _pow2_ceil_scale(xb.abs().amax(dim=-1))
    q = torch.clamp(xb / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize_fp8_per_vector(
    x_fp8: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_e4m3_per_vector`, in float32."""
    d = x_fp8.shape[-1]
    xb = x_fp8.float().reshape(*x_fp8.shape[:-1], d // block, block)
    return (xb * scale.float().unsqueeze(-1)).reshape(x_fp8.shape)


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise indexer queries ``q [..., H, 128]`` with one scale per (token, head).

    Returns ``(q_fp8 [..., H, 128], q_scale [..., H] float32)``. deep_gemm takes no query
    scale, so DeepSeek-V3.2 folds it into the head weights: the caller passes
    ``weights * q_scale`` (together with the ``H ** -0.5 * 128 ** -0.5`` factors) as the
    ``weights`` argument of ``fp8_paged_mqa_logits``; relu commutes with the positive scale.
    """
    if q.dim() < 2 or q.shape[-1] != QUANT_BLOCK:
        raise PlanError(
            "query must be [..., H, 128]",
            field="q",
            expected=f"[..., H, {QUANT_BLOCK}]",
            actual=tuple(q.shape),
        )
    q_fp8, scale = quantize_fp8_e4m3_per_vector(q)
    return q_fp8, scale.squeeze(-1)


def new_index_cache(
    num_blocks: int, head_dim: int = QUANT_BLOCK, device: torch.device | str | None = None
) -> torch.Tensor:
    """A zeroed index cache ``uint8 [num_blocks, 64, 1, head_dim + 4]``."""
    return torch.zeros(num_blocks, PAGE, 1, head_dim + 4, dtype=torch.uint8, device=device)


def _check_cache(cache: torch.Tensor) -> int:
    if cache.dtype != torch.uint8 or cache.dim() != 4:
        raise PlanError(
            "index cache must be uint8 [num_blocks, 64, 1, D + 4]",
            field="kv_cache",
            expected="uint8 4-D",
            actual=f"{cache.dtype} {tuple(cache.shape)}",
        )
    _, page, heads, width = cache.shape
    if page != PAGE or heads != 1 or width <= 4:
        raise PlanError(
            "index cache must be [num_blocks, 64, 1, D + 4]",
            field="kv_cache",
            expected=f"[n, {PAGE}, 1, D + 4]",
            actual=tuple(cache.shape),
        )
    if cache.stride(3) != 1 or cache.stride(2) != width or cache.stride(1) != width:
        raise PlanError(
            "index cache blocks must be dense inside",
            field="kv_cache",
            expected="stride(1) == D + 4 and stride(3) == 1",
            actual=tuple(cache.stride()),
        )
    if cache.stride(0) % 4 != 0 or cache.stride(0) < PAGE * width:
        raise PlanError(
            "block stride must hold a whole block and keep scales 4-byte aligned",
            field="kv_cache",
            expected=f">= {PAGE * width}, multiple of 4",
            actual=cache.stride(0),
        )
    return width - 4


def index_cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of a cache as ``(k_fp8 [nb, 64, D] e4m3, k_scale [nb, 64] float32)``.

    Writes through the views land in ``cache``; ``cache.stride(0)`` may exceed one block
    (a sliced pool), as deep_gemm allows.
    """
    d = _check_cache(cache)
    nb = cache.shape[0]
    flat = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1))
    k_fp8 = flat[:, : PAGE * d].unflatten(1, (PAGE, d)).view(torch.float8_e4m3fn)
    k_scale = flat[:, PAGE * d : PAGE * (d + 4)].view(torch.float32)
    return k_fp8, k_scale


def _check_slots(slots: torch.Tensor, n: int) -> None:
    if slots.dim() != 1 or slots.numel() != n or slots.dtype not in (torch.int32, torch.int64):
        raise PlanError(
            "slots must be int [N]",
            field="slots",
            expected=f"int [{n}]",
            actual=f"{slots.dtype} {tuple(slots.shape)}",
        )


def write_index_cache(
    cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor
) -> None:
    """Store keys ``k_fp8 [N, D]`` and scales ``k_scale [N]`` (or ``[N, 1]``) at ``slots [N]``.

    In place and without host syncs (CUDA-graph capturable). Slots are not range-checked
    (that would read them); out-of-range slots raise inside the indexing op.
    """
    k_view, s_view = index_cache_views(cache)
    d = k_view.shape[-1]
    if k_fp8.dtype != torch.float8_e4m3fn or k_fp8.dim() != 2 or k_fp8.shape[1] != d:
        raise PlanError(
            "keys must be float8_e4m3fn [N, D]",
            field="k_fp8",
            expected=f"e4m3 [N, {d}]",
            actual=f"{k_fp8.dtype} {tuple(k_fp8.shape)}",
        )
    n = k_fp8.shape[0]
    scale = k_scale.reshape(-1)
    if scale.numel() != n:
        raise PlanError("one scale per key", field="k_scale", expected=n, actual=scale.numel())
    _check_slots(slots, n)
    slots = slots.to(torch.int64)
    block = torch.div(slots, PAGE, rounding_mode="floor")
    offset = slots - block * PAGE
    # index_put_ on the uint8 bytes: fp8 index_put is not implemented on every backend.
    k_view.view(torch.uint8).index_put_((block, offset), k_fp8.view(torch.uint8))
    s_view.index_put_((block, offset), scale.to(torch.float32))


def quantize_into_index_cache(
    cache: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    rotation_scale: float = 1.0,
) -> None:
    """Quantise keys ``x [N, D]`` (one vector each, after ``bf16((x @ rotation.T) *
    rotation_scale)`` when ``rotation`` is given) and store them at ``slots [N]``.

    The same bytes as :func:`quantize_fp8_e4m3_per_vector` then :func:`write_index_cache`
    (the torch path here, off CUDA). On CUDA it is one Triton launch: the indexer writes a
    key every layer, and the quantisation, the slot arithmetic and the two ``index_put_``
    were about seven launches of a few KB each. There, slots outside the cache are skipped
    rather than raised on (the kernel cannot raise without a host sync; the planner's door
    range-checks ``out_cache_loc``); in place and capturable either way. The kernel rotates
    bf16 keys only (see ``fp8_triton``); other dtypes with a ``rotation`` take the torch path.
    """
    k_view, s_view = index_cache_views(cache)
    d = k_view.shape[-1]
    if not x.is_floating_point() or x.dim() != 2 or x.shape[1] != d:
        raise PlanError(
            "keys must be floating point [N, D]",
            field="x",
            expected=f"float [N, {d}]",
            actual=f"{x.dtype} {tuple(x.shape)}",
        )
    _check_slots(slots, x.shape[0])
    if slots.device != cache.device or x.device != cache.device:
        raise PlanError(
            "keys, slots and cache must share a device",
            field="slots",
            expected=str(cache.device),
            actual=f"x on {x.device}, slots on {slots.device}",
        )
    kernel_reads = x.dtype in KERNEL_DTYPES and (rotation is None or x.dtype == torch.bfloat16)
    if x.is_cuda and kernel_reads and triton_available(x.device):
        codes = k_view.view(torch.uint8)
        quantize_fp8_to_cache_triton(
            x, codes, s_view, slots, rotation=rotation, rotation_scale=rotation_scale
        )
        return
    if rotation is not None:
        x = ((x.float() @ rotation.float().t()) * rotation_scale).to(x.dtype)
    write_index_cache(cache, slots, *_quantize_torch(x, d))


def gather_index_cache(
    cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and scales of the given slots, in order: ``(k_fp8 [N, D], k_scale [N] float32)``.

    What the ragged prefill indexer (``fp8_mqa_logits``) reads: a flat KV
    gathered from the paged cache, request after request. Copies; no host sync.
    """
    k_view, s_view = index_cache_views(cache)
    slots = slots.to(torch.int64)
    block = torch.div(slots, PAGE, rounding_mode="floor")
    offset = slots - block * PAGE
    # A key's bytes move as the widest words its layout allows (8 bytes for D = 128):
    # torch's index kernel copies one element per thread, so bytes would take 8x the work.
    keys = as_words(k_view)[block, offset].view(torch.uint8).view(torch.float8_e4m3fn)
    return keys, s_view[block, offset]


def as_words(k_view: torch.Tensor) -> torch.Tensor:
    """``k_view [nb, 64, D]`` (1-byte elements) as the widest integer words (8, 4, 2 or 1
    bytes) that divide ``D``, its strides and its offset: the same bytes, fewer elements."""
    raw = k_view.view(torch.uint8)
    for word, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        aligned = raw.storage_offset() % word == 0 and raw.shape[-1] % word == 0
        if aligned and all(stride % word == 0 for stride in raw.stride()[:-1]):
            return raw.view(dtype)
    return raw


def pack_index_kv_cache(
    k_fp8: torch.Tensor, k_scale: torch.Tensor, slots: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """A new zeroed cache of ``num_blocks`` blocks holding the given keys at ``slots``."""
    cache = new_index_cache(num_blocks, k_fp8.shape[-1], device=k_fp8.device)
    write_index_cache(cache, slots, k_fp8, k_scale)
    return cache


def unpack_index_kv_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of a cache: ``(k_fp8 [num_blocks * 64, D], k_scale [num_blocks * 64])``.

    Copies; slot ``n`` is row ``n``.
    """
    k_view, s_view = index_cache_views(cache)
    return k_view.reshape(-1, k_view.shape[-1]).clone(), s_view.reshape(-1).clone()
