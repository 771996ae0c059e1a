"""MLA's cache write as one Triton launch: RMSNorm the latent, rope the key, store the row.

Unfused, each layer of a decode step wrote its cache row in five launches: the latent's
RMSNorm, the key's rope, a ``torch.cat``, a ``.to(cache dtype)`` and an ``index_put_``;
about 0.5 ms of a 61-layer step at 16 rows, almost all of it launch overhead and the idle
gap between kernels. Here a program owns one row of ``kva``: it reads the row once,
normalises the first ``D`` features, ropes the rest and stores both halves straight into
the row's cache slot. Nothing is allocated and nothing is read back to the host, so the
launch can be captured in a CUDA graph like the ops it replaces.

Bit-identity with the unfused CUDA path (``rms_norm_triton`` then
``rope_interleaved_triton``, cat, cast, ``index_put_``) is the contract, because the
cache bits feed every later step's attention and the GPU tests compare against them:

- the norm part is ``norm_triton._rms_norm_kernel``'s code with the same block, the same
  ``num_warps`` (imported from there, so the two cannot drift apart) and the same row
  alignment hint, so the compiler lays out and reduces the sum of squares in the same
  order;
- the rope part is ``rope_triton._rope_interleaved_kernel``'s arithmetic on one vector;
- like the rope kernel, the launch turns fp fusion off, which the norm kernel leaves on.
  That cannot change the norm's bits for the model's inputs: the square of a bf16 or fp16
  value is exact in fp32 (so an fma of ``x * x + acc`` rounds as the add alone), and
  times ``1/D`` is exact for a power-of-two ``D`` (512). fp32 inputs or other ``D`` may
  differ from the unfused kernel by that contraction, never from the torch formula by
  more than the norm kernel does.

Results round to ``kva``'s dtype first, then to the cache's, as the norm's output and the
cat's ``.to`` did. ``D`` and the rope width are compile-time constants (model constants);
rows, strides and ``eps`` are runtime values and unspecialised (``LazyKernel``), so a new
batch never compiles. On the CPU it runs under ``TRITON_INTERPRET=1`` for the tests; the
CPU model keeps its float64 torch path.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable, row_align
from dsv32_engine.models.layers.norm_triton import norm_warps

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["write_latent_kv_triton"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Keep each output's two products apart, as rope_triton does (see the module docstring).
_EXACT = {"enable_fp_fusion": False}


def _kv_write_kernel(
    cache_ptr,
    kva_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    loc_ptr,
    kva_stride,
    cache_stride,
    cos_stride,
    sin_stride,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    KVA_ALIGN: tl.constexpr,
    CACHE_ALIGN: tl.constexpr,
):
    # Offsets in int64: slots * 576 and rows * stride pass 2**31 in large caches.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    x_row = row * kva_stride
    out_row = slot * cache_stride
    if KVA_ALIGN > 1:
        # What the unfused norm promises about the same view: the same hint keeps the
        # same vector layout, hence the same order of the sum below.
        x_row = tl.multiple_of(x_row, KVA_ALIGN)
    if CACHE_ALIGN > 1:
        out_row = tl.multiple_of(out_row, CACHE_ALIGN)
    in_dtype = kva_ptr.dtype.element_ty
    out_dtype = cache_ptr.dtype.element_ty

    # RMSNorm of features [0, D), as norm_triton computes it.
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(kva_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) * (1.0 / D)
    y = (x * tl.rsqrt(mean_sq + eps)) * w
    tl.store(cache_ptr + out_row + cols, y.to(in_dtype).to(out_dtype), mask=mask)

    # Interleaved rope of features [D, D + 2 * HALF), as rope_triton computes it.
    pair = tl.arange(0, HALF_BLOCK)
    live = pair < HALF
    x_at = kva_ptr + x_row + D + 2 * pair
    a = tl.load(x_at, mask=live, other=0.0).to(tl.float32)
    b = tl.load(x_at + 1, mask=live, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + row * cos_stride + pair, mask=live, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * sin_stride + pair, mask=live, other=0.0).to(tl.float32)
    out_at = cache_ptr + out_row + D + 2 * pair
    tl.store(out_at, (a * c - b * s).to(in_dtype).to(out_dtype), mask=live)
    tl.store(out_at + 1, (a * s + b * c).to(in_dtype).to(out_dtype), mask=live)


_kv_write = LazyKernel(_kv_write_kernel, aligned=True)


def _check(
    kva: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    loc: torch.Tensor,
) -> tuple[int, int]:
    """Shapes, dtypes, devices and strides, from metadata only (no sync); ``(D, half)``.

    Layouts the kernel cannot address in place are refused rather than copied: a copy
    would be an allocation inside a captured graph, and the model never passes one."""
    device = kva.device
    for name, t in (("norm_weight", norm_weight), ("cos", cos), ("sin", sin)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, kva on {device}")
    for name, t in (("kv_cache", kv_cache), ("loc", loc)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, kva on {device}")
    if kva.dim() != 2 or kva.stride(-1) != 1:
        raise ValueError(
            f"kva must be [rows, D + rope] with unit feature stride, got shape "
            f"{tuple(kva.shape)} strides {kva.stride()}"
        )
    if norm_weight.dim() != 1:
        raise ValueError(f"norm_weight must be [D], got shape {tuple(norm_weight.shape)}")
    rows, width = kva.shape
    d = norm_weight.shape[0]
    rope = width - d
    if d < 1 or rope < 2 or rope % 2:
        raise ValueError(f"kva's {width} features must be D={d} then an even rope width > 0")
    half = rope // 2
    if kv_cache.dim() != 2 or kv_cache.shape[1] != width or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"kv_cache must be [slots, {width}] with unit feature stride, got shape "
            f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] not in (1, rows) or t.shape[1] != half:
            raise ValueError(f"{name} must be [{rows} or 1, {half}], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got {t.stride()}")
    if loc.dim() != 1 or loc.shape[0] != rows:
        raise ValueError(f"loc must be [{rows}], got shape {tuple(loc.shape)}")
    if loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be int32 or int64, got {loc.dtype}")
    for name, t in (("kva", kva), ("kv_cache", kv_cache)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    for name, t in (("norm_weight", norm_weight), ("cos", cos), ("sin", sin)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if not norm_weight.is_contiguous():
        raise ValueError("norm_weight must be contiguous")
    return d, half


def write_latent_kv_triton(
    kva: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """``kv_cache[loc[r]] = cat(rms_norm(kva[r, :D]), rope(kva[r, D:]))`` for every row, in
    one launch, with ``D = len(norm_weight)``.

    ``kva [rows, D + rope]`` may be a column view of a wider GEMM output (any row stride,
    unit feature stride); ``cos``/``sin`` are ``[rows, rope/2]`` (or one row, broadcast)
    with any row stride; ``kv_cache [slots, D + rope]`` is written in place; ``loc [rows]``
    is int32 or int64 on the same device. Slots are not range-checked (that would read
    ``loc`` back to the host): the plan guarantees ``0 <= loc < slots``, unique per batch.
    Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    require_launchable(kva.device, "sum")
    d, half = _check(kva, norm_weight, cos, sin, kv_cache, loc)
    rows = kva.shape[0]
    if rows == 0:
        return
    # One row: its offset is 0 whatever the stride, so report the contiguous width and
    # keep the variant what rms_norm_triton would pick for that row.
    kva_stride = kva.stride(0) if rows > 1 else d
    cache_stride = kv_cache.stride(0)
    block = triton.next_power_of_2(d)
    _kv_write[(rows,)](
        kv_cache,
        kva,
        norm_weight,
        cos,
        sin,
        loc,
        kva_stride,
        cache_stride,
        cos.stride(0) if cos.shape[0] > 1 else 0,
        sin.stride(0) if sin.shape[0] > 1 else 0,
        float(eps),
        D=d,
        BLOCK=block,
        HALF=half,
        HALF_BLOCK=triton.next_power_of_2(half),
        KVA_ALIGN=row_align(kva_stride, kva.dtype),
        CACHE_ALIGN=row_align(cache_stride, kv_cache.dtype),
        num_warps=norm_warps(block),
        **_EXACT,
    )
