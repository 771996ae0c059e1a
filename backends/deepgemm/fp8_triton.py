"""DeepSeek-V3.2's per-vector fp8 e4m3 quantisation as one Triton launch, for CUDA tensors.

The torch recipe in ``fp8.quantize_fp8_e4m3_per_vector_reference`` is about ten kernels (cast,
abs, amax, clamp, divide, frexp, where, ldexp, divide, clamp, cast), and the indexer runs it
twice a layer: over a 61-layer decode step that is over a thousand launches, each moving a
few KB. Here a program reads a tile of vectors once and writes their fp8 bytes and scales.

Bit-identical to the torch recipe, and the same on the GPU as under the interpreter,
because nothing that depends on the platform's float rounding is left in it:

- **Scale.** ``2 ** ceil(log2(max(amax, 1e-4) / 448))`` is decided by the integer bits of
  ``c = max(amax, 1e-4)`` alone: with ``c = 1.f * 2**e``, it is ``2 ** (e - 8)`` when
  ``1.f <= 1.75`` (448 is ``1.75 * 2**8``) and ``2 ** (e - 7)`` otherwise. The fp32 ratio
  the torch code rounds (``c / 448`` on the CPU; ``c * fp32(1 / 448)`` on CUDA, where torch
  divides by a Python scalar through its reciprocal) is at most ``2**k`` exactly when
  ``c <= 448 * 2**k``: up to that bound even CUDA's ratio, 0.76 half-ulps high, stays below
  the midpoint above ``2**k``, and the next fp32 ``c`` puts the true ratio 1.14 half-ulps
  above ``2**k``, past it. (Checked for every fp32 amax, against both ratios.) So no
  division is needed, and neither Triton's approximate ``/`` nor the two devices' torch
  formulas matter. The amax itself is an integer max over ``|x|``'s bits (for
  non-negative floats the same order), so a NaN wins it instead of being dropped by a
  float max; a NaN or infinite vector gets scale 1, which is what torch's ``frexp``
  (exponent 0) gives.
- **Values.** ``x / s`` is ``x * (1 / s)`` with ``1 / s`` an exact power of two (between
  ``2**-120`` and ``2**22``), so the product is the same correctly rounded number; where
  it underflows, it rounds to a signed fp8 zero either way. The clamp is written with
  compares, so a NaN passes through as torch's clamp lets it. The fp8 byte is then built
  with integer arithmetic: c10's round-to-nearest-even for normal fp8 values and an
  explicit round-half-even shift for subnormals. Triton's own ``.to(tl.float8e4nv)`` is
  not used: the interpreter's version rounds ties away from zero and breaks on a mantissa
  carry, so it could not be tested bit for bit on the CPU.

Two more outputs ride on the same launch, each replacing small torch kernels a layer: the
indexer's key can be stored straight into the paged index cache at its slot (instead of
new tensors and a ``write_index_cache`` of about six launches, two of them ``index_put_``),
and the indexer's query can return its head weights times its scale (one multiply kernel).

Vector size is a compile-time constant (128 in the model); vector counts and row strides
are runtime values, unspecialised by ``LazyKernel``, so a new batch never compiles
mid-serving. The launch allocates through torch and reads nothing back to the host, so it
can be captured in a CUDA graph. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors, which
is how it is tested without a GPU; ``quantize_fp8_e4m3_per_vector`` only sends it CUDA ones.
"""

from __future__ import annotations

import math

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable, row_align, rows_view

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = [
    "KERNEL_DTYPES",
    "quantize_fp8_to_cache_triton",
    "quantize_fp8_triton",
    "quantize_fp8_weighted_triton",
]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Input dtypes the kernel reads (widening to fp32, or rounding fp64 to it, as ``x.float()``
does); fp8 inputs stay on the torch path."""

# Elements per program: enough to amortise the per-program cost, 16 a thread at 4 warps.
_TILE = 2048
# fp32(1e-4), the amax floor, as bits: 0x38D1B717.
_FLOOR_BITS = int(torch.tensor(1e-4, dtype=torch.float32).view(torch.int32))


def _quantize_kernel(
    q_ptr,
    s_ptr,
    x_ptr,
    r_ptr,
    slot_ptr,
    w_ptr,
    ws_ptr,
    r_scale,
    vectors,
    groups,
    x_stride,
    pages,
    q_page_stride,
    s_page_stride,
    FLOOR_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    ROTATE: tl.constexpr,
    DOT_F32: tl.constexpr,
    TO_CACHE: tl.constexpr,
    PAGE: tl.constexpr,
    Q_ALIGN: tl.constexpr,
    WEIGHTS: tl.constexpr,
):
    # Vector v is group v % groups of row v // groups. Offsets in int64: rows * stride
    # passes 2**31 in a long prefill.
    vec = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = vec < vectors
    row = vec // groups
    start = row * x_stride + (vec - row * groups) * BLOCK
    if ROW_ALIGN > 1:
        # The launcher checked that stride and BLOCK are multiples of ROW_ALIGN; without
        # the hint the unspecialised stride would make every load a scalar one.
        start = tl.multiple_of(start, ROW_ALIGN)
    cols = tl.arange(0, BLOCK_P2)
    mask = live[:, None]
    if BLOCK_P2 != BLOCK:
        mask = mask & (cols < BLOCK)[None, :]
    x = tl.load(x_ptr + start[:, None] + cols[None, :], mask=mask, other=0.0)
    if ROTATE:
        # y = round_bf16((x @ R^T) * r_scale): R (the indexer's Hadamard, +-1) times bf16
        # values are exact products, summed in fp32 as the torch path's fp32 matmul does
        # (in another order: equal whenever the sums are exact in fp32, as they are for
        # activations whose exponents span under 16 binades), then scaled and rounded to
        # bf16 to nearest even, which is the torch path's ``.to(bfloat16)``.
        rt = tl.load(r_ptr + cols[None, :] * BLOCK + cols[:, None])  # rt[k, n] = R[n, k]
        if DOT_F32:  # the interpreter multiplies bf16 bit patterns as integers
            y = tl.dot(x.to(tl.float32), rt.to(tl.float32), input_precision="ieee")
        else:
            y = tl.dot(x, rt.to(x.dtype))
        y = y * r_scale
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000 as an int32
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)

    # Scale: see the module docstring. Masked lanes read +0, which never wins the max.
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    c = tl.maximum(amax, FLOOR_BITS)
    exp = c >> 23
    biased = exp - 8 + ((c & 0x7FFFFF) > 0x600000).to(tl.int32)  # k + 127 for s = 2**k
    finite = exp < 255
    scale = tl.where(finite, biased << 23, 127 << 23).to(tl.float32, bitcast=True)
    inverse = tl.where(finite, (254 - biased) << 23, 127 << 23).to(tl.float32, bitcast=True)

    y = x * inverse[:, None]
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))

    # fp32 -> e4m3fn, round to nearest even, |y| <= 448 or NaN.
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = mag >> 23
    # |y| >= 2**-6 (fp8 normal): c10's trick, rebias the exponent and add 0x7FFFF plus
    # the kept mantissa's low bit before dropping the 20 extra mantissa bits.
    normal = (mag + (((7 - 127) << 23) + 0x7FFFF) + ((mag >> 20) & 1)) >> 20
    # |y| < 2**-6: the multiple of 2**-9 nearest |y|, ties to even, from the 24-bit
    # significand. Shifts past 24 all give 0 (for fp32 subnormals too), so 30 caps them;
    # the floor of 1 only keeps the unused lanes of normal values defined.
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e, 1), 30)
    quot = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((quot & 1) == 1))
    code = tl.where(e >= 121, normal, quot + up.to(tl.int32))
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN keeps its sign, as in c10
    code = code | ((bits >> 24) & 0x80)

    if TO_CACHE:
        # Vector v is the key of slot slots[v]: page slot // PAGE, offset slot % PAGE of the
        # index cache, whose codes and scales live in separate regions of each page (see
        # fp8.py). A slot outside the cache writes nothing: torch's index_put_ would raise
        # (or wrap a negative one), and a kernel cannot raise without a host sync.
        slot = tl.load(slot_ptr + vec, mask=live, other=-1).to(tl.int64)
        page = slot // PAGE
        keep = live & (slot >= 0) & (page < pages)
        at = slot - page * PAGE
        q_at = page * q_page_stride + at * BLOCK
        if Q_ALIGN > 1:
            # The launcher checked the page stride and BLOCK: wide stores, not byte ones.
            q_at = tl.multiple_of(q_at, Q_ALIGN)
        q_mask = keep[:, None]
        if BLOCK_P2 != BLOCK:
            q_mask = q_mask & (cols < BLOCK)[None, :]
        tl.store(q_ptr + q_at[:, None] + cols[None, :], code.to(tl.uint8), mask=q_mask)
        tl.store(s_ptr + page * s_page_stride + at, scale, mask=keep)
    else:
        tl.store(q_ptr + vec[:, None] * BLOCK + cols[None, :], code.to(tl.uint8), mask=mask)
        tl.store(s_ptr + vec, scale, mask=live)
    if WEIGHTS:
        # The indexer's head weights times the query scale (deep_gemm takes no query scale):
        # one fp32 product, the torch multiply's rounding, without its launch.
        w = tl.load(w_ptr + vec, mask=live, other=0.0)
        tl.store(ws_ptr + vec, w * scale, mask=live)


_quantize = LazyKernel(_quantize_kernel, aligned=True)


def _check_rotation(x: torch.Tensor, block: int, rotation: torch.Tensor) -> None:
    """What the rotated variant needs: bf16 vectors (it rounds to bf16), a square fp32
    matrix of the vector size on x's device, and a power-of-2 size >= 16 (a tensor-core
    tile; 16 vectors a program make the dot's M)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the rotated variant reads bfloat16 vectors, got {x.dtype}")
    if block < 16 or block & (block - 1) or _TILE // block < 16:
        raise ValueError(f"the rotated variant needs a power-of-2 block in [16, 128], got {block}")
    if (
        tuple(rotation.shape) != (block, block)
        or rotation.dtype != torch.float32
        or rotation.device != x.device
        or not rotation.is_contiguous()
    ):
        raise ValueError(
            f"rotation must be a contiguous float32 [{block}, {block}] on {x.device}, got "
            f"{rotation.dtype} {tuple(rotation.shape)} on {rotation.device}"
        )


def _check_input(x: torch.Tensor, block: int, rotation: torch.Tensor | None) -> None:
    require_launchable(x.device, "max")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel reads {KERNEL_DTYPES}, got {x.dtype}")
    if x.dim() == 0 or block < 1 or x.shape[-1] % block:
        raise ValueError(f"need x [..., k * {block}], got {tuple(x.shape)}")
    if rotation is not None:
        _check_rotation(x, block, rotation)


def _launch(
    x: torch.Tensor,
    block: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    rotation: torch.Tensor | None,
    rotation_scale: float,
    *,
    slots: torch.Tensor | None = None,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One launch over ``x``'s vectors into ``q`` (uint8 bytes) and ``scale``: dense
    ``[vectors, block]`` / ``[vectors]`` outputs, or, with ``slots``, the index cache's
    code and scale views ``[pages, 64, block]`` / ``[pages, 64]`` (any page stride).
    ``weights = (w, out)``: ``out = w * scale`` per vector, both fp32 and dense."""
    x2 = rows_view(x)
    rows = x2.shape[0]
    d = x.shape[-1]
    # One row: its offset is 0 whatever the stride, so report D and keep the variant
    # (ROW_ALIGN) the same as for many rows of a contiguous input.
    stride = x2.stride(0) if rows > 1 else d
    groups = d // block
    vectors = rows * groups
    block_p2 = triton.next_power_of_2(block)
    per_program = max(_TILE // block_p2, 1)
    to_cache = slots is not None
    pages, q_page, s_page = (q.shape[0], q.stride(0), scale.stride(0)) if to_cache else (0, 0, 0)
    w, ws = weights if weights is not None else (x2, x2)
    _quantize[(triton.cdiv(vectors, per_program),)](
        q,
        scale,
        x2,
        x2 if rotation is None else rotation,
        slots if to_cache else x2,
        w,
        ws,
        rotation_scale,
        vectors,
        groups,
        stride,
        pages,
        q_page,
        s_page,
        FLOOR_BITS=_FLOOR_BITS,
        BLOCK=block,
        BLOCK_P2=block_p2,
        ROWS=per_program,
        ROW_ALIGN=row_align(math.gcd(stride, block), x.dtype),
        ROTATE=rotation is not None,
        DOT_F32=x.device.type != "cuda",
        TO_CACHE=to_cache,
        PAGE=q.shape[1] if to_cache else 1,
        Q_ALIGN=row_align(math.gcd(q_page, block), torch.uint8) if to_cache else 1,
        WEIGHTS=weights is not None,
        num_warps=min(max(per_program * block_p2 // 512, 1), 8),
    )


def quantize_fp8_triton(
    x: torch.Tensor,
    block: int,
    *,
    rotation: torch.Tensor | None = None,
    rotation_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [..., D] float8_e4m3fn, scale [..., D // block] float32)``, bit for bit as
    the torch recipe, in one launch. Input checks with the user-facing messages are the
    caller's (``fp8.quantize_fp8_e4m3_per_vector``); this only refuses what it cannot run.
    Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.

    ``rotation`` (``[block, block]``, entries exact in bf16: the indexer's Hadamard) first
    maps each bf16 vector to ``bf16((v @ rotation.T) * rotation_scale)`` inside the same
    launch, which the torch path spends five kernels and an fp32 GEMM on.
    """
    _check_input(x, block, rotation)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32, device=x.device)
    if q.numel():
        _launch(x, block, q.view(torch.uint8), scale, rotation, rotation_scale)
    return q, scale


def quantize_fp8_weighted_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    rotation_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_fp8_triton(x, D)`` (one vector per row of the last dim: the indexer's
    query heads) plus ``weights * scale`` (``weights [...]`` fp32 of ``x.shape[:-1]``) from
    the same launch: the query's head weights with its fp8 scale folded in, which would
    otherwise be one more launch a layer. Returns ``(x_fp8, scale [..., 1], weighted)``."""
    block = x.shape[-1] if x.dim() else 0
    _check_input(x, block, rotation)
    if weights.shape != x.shape[:-1] or weights.dtype != torch.float32:
        raise ValueError(
            f"weights must be float32 {tuple(x.shape[:-1])}, "
            f"got {weights.dtype} {tuple(weights.shape)}"
        )
    if weights.device != x.device:
        raise ValueError(f"weights are on {weights.device}, x on {x.device}")
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    weighted = torch.empty(weights.shape, dtype=torch.float32, device=x.device)
    if q.numel():
        w = weights.contiguous()
        _launch(x, block, q.view(torch.uint8), scale, rotation, rotation_scale,
                weights=(w, weighted))  # fmt: skip
    return q, scale, weighted


def quantize_fp8_to_cache_triton(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    rotation_scale: float = 1.0,
) -> None:
    """Quantise (and rotate) each row of ``x [N, D]`` as one vector and store its fp8 bytes
    and scale straight into an index cache at ``slots [N]`` (int32 or int64): ``codes`` and
    ``scales`` are the cache's views from ``fp8.index_cache_views`` (``codes`` as uint8),
    whose page strides the kernel follows. Bytes as ``quantize_fp8_triton`` followed by
    ``fp8.write_index_cache``, in one launch instead of about six. The user-facing checks
    are ``fp8.quantize_into_index_cache``'s; this refuses only what it cannot run."""
    block = x.shape[-1] if x.dim() else 0
    _check_input(x, block, rotation)
    if x.dim() != 2:
        raise ValueError(f"need x [N, D], got {tuple(x.shape)}")
    pages, page = codes.shape[:2] if codes.dim() == 3 else (0, 0)
    if (
        codes.dtype != torch.uint8
        or tuple(codes.shape) != (pages, page, block)
        or codes.stride()[1:] != (block, 1)
        or scales.dtype != torch.float32
        or tuple(scales.shape) != (pages, page)
        or scales.stride(1) != 1
    ):
        raise ValueError(
            f"need codes uint8 [pages, page, {block}] and scales float32 [pages, page], dense "
            f"inside a page; got {codes.dtype} {tuple(codes.shape)} {codes.stride()} and "
            f"{scales.dtype} {tuple(scales.shape)} {scales.stride()}"
        )
    if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"need slots int [{x.shape[0]}], got {slots.dtype} {tuple(slots.shape)}")
    if not (codes.device == scales.device == slots.device == x.device):
        raise ValueError(
            f"x on {x.device}, codes on {codes.device}, scales on {scales.device}, "
            f"slots on {slots.device}"
        )
    if x.shape[0] and pages:
        _launch(x, block, codes, scales, rotation, rotation_scale, slots=slots.contiguous())
