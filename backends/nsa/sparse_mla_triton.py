"""Sparse MLA decode in Triton: split-KV attention over each row's top-k slots.

Same function as ``backends.nsa.attention.sparse_mla_decode`` (absorbed MLA over the
indexer's selected slots, ``-1`` entries ignored, zeros for a row with no valid slot),
at tensor-core speed, with its split schedule taken from a per-batch plan
(``backends.nsa.sparse_mla_plan``: what is static per capture size, what the plan holds).

How it runs (flash-decoding, MLA flavour):

* **Attend** (one launch, ``rows x splits x head_blocks`` programs, head block fastest so
  the programs sharing a KV tile run together and the second one hits L2): a program
  takes one (row, split) and ``block_h`` heads, gathers the split's KV rows ``block_n``
  at a time by slot (1152 contiguous bytes each at the real shape: coalesced 16-byte
  loads), computes ``[heads, block_n]`` logits over latent + rope with two ``tl.dot``,
  keeps an fp32 online softmax (running max and sum, base 2) and accumulates ``p @
  latent`` on the tensor cores. Every gathered row is reused by all ``block_h`` heads:
  that is what makes MLA decode cheap in bytes. With one split (large batches) it
  normalises and writes the output itself; otherwise it writes a normalised fp32
  partial and its log-sum-exp into the workspace. An empty split writes nothing.
* **Combine** (only when ``splits > 1``): per (row, head, latent chunk), weights the
  live splits' partials by ``exp(lse - max)`` in one tile, no loop over splits (a
  serial loop would pay one L2 latency per split).

Numerics: bf16/fp16 operands, fp32 logits, softmax and accumulation; ``p`` is rounded
to the KV dtype for the second product (as every tensor-core flash kernel does) and the
output to the query dtype. Against the fp32 torch reference expect about 2e-3 relative
error (Frobenius; the output's own bf16 rounding is 1.7e-3 of it) and under 1e-2 in the
worst case for bf16; fp32 inputs (tests only) use IEEE dots and agree to ~1e-6.

Compile-time specialisation is limited to the model's fixed shapes (heads, latent,
rope), the tile config, the dtype, whether there is one split, and (combine only) the
split count rounded up to a power of two, which is static per capture size. Row counts,
strides and the scale are runtime values, so serving never compiles mid-batch. Strides
travel divided by 8 (they are checked to be multiples of 8 elements): the launcher does
not specialise sizes, and this is how the compiler still learns the 16-byte alignment it
needs for vector loads. Slot values are not checked (that would need a host sync): they
must be ``-1`` or ``< kv_cache.shape[0]``, and positions at or past a row's last plan
boundary are not read (the indexer writes ``-1`` there).

Under ``TRITON_INTERPRET=1`` (CPU tests) the dot operands are upcast to fp32 after the
same roundings: the interpreter multiplies bf16 bit patterns as integers.
"""

from __future__ import annotations

import math

import torch

from backends.common.triton_kernels import LazyKernel, triton_available
from backends.common.triton_launch import next_power_of_2
from backends.nsa.sparse_mla_checks import check_inputs, check_out, check_workspace, strides8
from backends.nsa.sparse_mla_plan import (
    DEFAULT_CONFIG,
    SparseMLAConfig,
    head_blocks,
    new_workspace,
    workspace_numel,
)
from planner.errors import PlanError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["sparse_mla_decode_triton"]

_LOG2E = 1.4426950408889634
# Combine tiles hold at most this many fp32 values (32 registers a thread at 4 warps).
_COMBINE_TILE = 4096


def _attend_kernel(
    q_ptr,
    qr_ptr,
    kv_ptr,
    slots_ptr,
    plan_ptr,
    out_ptr,
    ws_o_ptr,
    ws_lse_ptr,
    splits,
    q_row8,
    q_head8,
    qr_row8,
    qr_head8,
    kv_row8,
    slots_row,
    out_row8,
    out_head8,
    scale_log2,
    HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    DIRECT: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    DOT_F32: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % HEAD_BLOCKS
    item = pid // HEAD_BLOCKS
    split = item % splits
    row = (item // splits).to(tl.int64)
    begin = tl.load(plan_ptr + row * (splits + 1) + split)
    end = tl.load(plan_ptr + row * (splits + 1) + split + 1)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < HEADS
    dl = tl.arange(0, LATENT)
    dr = tl.arange(0, ROPE)
    q = tl.load(
        q_ptr + row * (q_row8 * 8) + h[:, None] * (q_head8 * 8) + dl[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    qr = tl.load(
        qr_ptr + row * (qr_row8 * 8) + h[:, None] * (qr_head8 * 8) + dr[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
        qr = qr.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    slot_row = slots_ptr + row * slots_row
    for start in range(begin, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_row + offs, mask=offs < end, other=-1)
        valid = slot >= 0
        base = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * (kv_row8 * 8)
        lat = tl.load(base[:, None] + dl[None, :], mask=valid[:, None], other=0.0)
        kr = tl.load(base[:, None] + LATENT + dr[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            lat = lat.to(tl.float32)
            kr = kr.to(tl.float32)
            s = tl.dot(q, tl.trans(lat), input_precision="ieee")
            s = tl.dot(qr, tl.trans(kr), acc=s, input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(lat))
            s = tl.dot(qr, tl.trans(kr), acc=s)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_tile = tl.max(s, axis=1)
        # The max stays -inf while only holes were seen; exponents are then offset by 0
        # (exp2(-inf - 0) = 0), never by -inf (exp2(-inf - -inf) = nan).
        if LAZY_RESCALE:
            # Keep the old max until some row's grows by more than 2^8 (p stays <= 256,
            # harmless in fp32 sums and bf16 products): the 64 x 512 rescale and its
            # multiplies then run only a few times per row instead of every tile.
            if tl.max((m_tile > m + 8.0).to(tl.int32), axis=0) > 0:
                m_new = tl.maximum(m, m_tile)
                alpha = tl.exp2(m - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                denom = denom * alpha
                m = m_new
        else:
            m_new = tl.maximum(m, m_tile)
            alpha = tl.exp2(m - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * alpha[:, None]
            denom = denom * alpha
            m = m_new
        p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
        denom = denom + tl.sum(p, axis=1)
        if RTNE_BF16:  # interpreter, bf16: the GPU's round-to-nearest-even, kept in fp32
            bits = p.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            acc = tl.dot(bits.to(tl.float32, bitcast=True), lat, acc=acc)
        elif DOT_F32:
            p_op = p.to(kv_ptr.dtype.element_ty).to(tl.float32)
            acc = tl.dot(p_op, lat, acc=acc, input_precision="ieee")
        else:  # p rounded to the KV dtype, as the tensor cores take it
            acc = tl.dot(p.to(kv_ptr.dtype.element_ty), lat, acc=acc)

    has = denom > 0.0
    o = acc / tl.where(has, denom, 1.0)[:, None]
    if DIRECT and RTNE_BF16:  # the interpreter's cast truncates: round first
        bits = o.to(tl.uint32, bitcast=True)
        o = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    if DIRECT:
        dst = out_ptr + row * (out_row8 * 8) + h[:, None] * (out_head8 * 8) + dl[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        # The split's emptiness as a vector: the interpreter rejects scalar & vector masks.
        live = hmask & (tl.zeros([BLOCK_H], tl.int32) + begin < end)
        lse = tl.where(
            has, (m + tl.log2(tl.where(has, denom, 1.0))) * 0.6931471805599453, float("-inf")
        )
        idx = (row * splits + split) * HEADS + h
        tl.store(ws_o_ptr + idx[:, None] * LATENT + dl[None, :], o, mask=live[:, None])
        tl.store(ws_lse_ptr + idx, lse, mask=live)


def _combine_kernel(
    ws_o_ptr,
    ws_lse_ptr,
    plan_ptr,
    out_ptr,
    splits,
    out_row8,
    out_head8,
    HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid % (LATENT // BLOCK_L)
    item = pid // (LATENT // BLOCK_L)
    head = item % HEADS
    row = (item // HEADS).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = chunk * BLOCK_L + tl.arange(0, BLOCK_L)
    in_plan = s < splits
    begin = tl.load(plan_ptr + row * (splits + 1) + s, mask=in_plan, other=0)
    end = tl.load(plan_ptr + row * (splits + 1) + s + 1, mask=in_plan, other=0)
    live = in_plan & (begin < end)  # empty splits were never written
    idx = (row * splits + s) * HEADS + head
    lse = tl.load(ws_lse_ptr + idx, mask=live, other=float("-inf"))
    part = tl.load(ws_o_ptr + idx[:, None] * LATENT + d[None, :], mask=live[:, None], other=0.0)
    top = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    den = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.where(den > 0.0, den, 1.0)
    if RTNE_BF16:
        bits = o.to(tl.uint32, bitcast=True)
        o = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    dst = out_ptr + row * (out_row8 * 8) + head * (out_head8 * 8) + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty))


_attend = LazyKernel(_attend_kernel, aligned=True)
_combine = LazyKernel(_combine_kernel, aligned=True)


# --- launcher ----------------------------------------------------------------------


def sparse_mla_decode_triton(
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
    *,
    split_plan: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    config: SparseMLAConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Absorbed sparse MLA decode ``o [rows, H, latent]`` (q's dtype), as ``sparse_mla_decode``.

    ``split_plan`` is the batch's table from ``sparse_mla_split_plan`` (its column count
    fixes the split count and so the grids); ``workspace`` (fp32, ``workspace_numel``
    long) is needed when there is more than one split and is allocated here if omitted
    (pass a static one under CUDA graphs). No host sync: capturable.
    """
    rows, heads, latent, rope, splits = check_inputs(
        q_nope_abs, q_rope, kv_cache, topk_slots, split_plan
    )
    if not math.isfinite(softmax_scale):
        raise PlanError(
            "must be finite", field="softmax_scale", expected="a finite float", actual=softmax_scale
        )
    device = q_nope_abs.device
    if out is None:
        out = torch.empty_like(q_nope_abs, memory_format=torch.contiguous_format)
    check_out(out, q_nope_abs)
    q_row8, q_head8 = strides8(q_nope_abs, "q_nope_abs")
    qr_row8, qr_head8 = strides8(q_rope, "q_rope")
    out_row8, out_head8 = strides8(out, "out")
    direct = splits == 1
    need = workspace_numel(rows, splits, heads, latent)
    if not direct:
        if workspace is None:
            workspace = new_workspace(rows, splits, heads, latent, device)
        check_workspace(workspace, need, device)
    if rows == 0:
        return out
    if not triton_available(device):
        raise RuntimeError(
            f"Triton kernels cannot run on {device}: they need CUDA, or CPU tensors"
            " with TRITON_INTERPRET=1"
        )
    n_o = rows * splits * heads * latent
    ws_o = out if direct else workspace[:n_o]
    ws_lse = out if direct else workspace[n_o:need]
    block_h = min(config.block_h, max(16, next_power_of_2(heads)))
    blocks = head_blocks(heads, block_h)
    _attend[(rows * splits * blocks,)](
        q_nope_abs,
        q_rope,
        kv_cache,
        topk_slots,
        split_plan,
        out,
        ws_o,
        ws_lse,
        splits,
        q_row8,
        q_head8,
        qr_row8,
        qr_head8,
        kv_cache.stride(0) // 8,
        topk_slots.stride(0),
        out_row8,
        out_head8,
        softmax_scale * _LOG2E,
        HEADS=heads,
        LATENT=latent,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        HEAD_BLOCKS=blocks,
        DIRECT=direct,
        LAZY_RESCALE=config.lazy_rescale,
        DOT_F32=device.type != "cuda" or q_nope_abs.dtype == torch.float32,
        RTNE_BF16=device.type != "cuda" and q_nope_abs.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct:
        block_s = max(2, next_power_of_2(splits))
        block_l = min(latent, max(16, _COMBINE_TILE // block_s))
        _combine[(rows * heads * (latent // block_l),)](
            ws_o,
            ws_lse,
            split_plan,
            out,
            splits,
            out_row8,
            out_head8,
            HEADS=heads,
            LATENT=latent,
            BLOCK_S=block_s,
            BLOCK_L=block_l,
            RTNE_BF16=device.type != "cuda" and q_nope_abs.dtype == torch.bfloat16,
            num_warps=4,
        )
    return out
