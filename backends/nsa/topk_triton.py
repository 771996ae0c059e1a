"""Length-aware row top-k as one Triton program per row: radix select, then compaction.

``torch.topk`` over the plan width scores and sorts every column of every row, so a
decode batch padded to ``max_context`` pays for 16k columns where a row has 300 valid
tokens, and rows whose whole KV fits in ``k`` sort for nothing. Here each program
reads only its row's ``[0, L)``:

1. **Radix select** on order-preserving uint32 keys of the scores (see
   ``topk_ref.order_keys``): up to 8 passes of 4 bits, each a 16-bin histogram of
   the candidates that match the digits fixed so far, find the k-th largest key.
   A pass stops the search early when the k-th element's bucket is taken whole
   (typical for distinct scores after 3-5 passes); with ties it runs all 8 and
   the threshold is the exact key.
2. **Compaction** walks ``[0, L)`` in order with running prefix counts: keys above
   the threshold are taken, keys equal to it are taken lowest position first
   until the budget is spent. Output is therefore ascending, then ``-1`` padding.

Rows with ``L <= k`` skip both passes over the scores and write ``0 .. L-1``. The
semantics (ties, NaN, ``-0.0``, padding) are ``topk_ref.reference_row_topk``'s, bit for
bit. Grid ``(rows,)`` from shapes only: no host sync, capturable in a CUDA graph.

Optionally (``MAP_SLOTS``) the compaction stores ``slots[row // next_n, pos]`` instead of
``pos``, which is ``topk_ref.map_positions_to_slots`` of the positions bit for bit. The
decode indexer wants slots; mapping them afterwards in torch took ~8 small launches a
layer, here it is one gather per chosen entry in the launch that already writes it.
``MAP_SLOTS`` is a compile-time flag so the positions-only variant is unchanged.

This chunked kernel is ``variant="chunked"``, kept so benchmarks can compare. The
default, ``variant="resident"`` (``topk_triton_resident``), keeps a row's scores in
registers across histogram passes instead of re-reading them in every pass: the same
result, at about 2.5x less latency at decode sizes, which one program per row is bound by.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable
from backends.nsa.topk_ref import check_row_topk, check_slot_map
from backends.nsa.topk_triton_resident import (
    MAX_RESIDENT_WIDTH,
    RESIDENT_CHOICES,
    row_topk_resident,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["RESIDENT_DEFAULTS", "VARIANTS", "default_resident", "row_topk_triton"]

VARIANTS = ("resident", "chunked")

# Scores per chunk of a pass. The histogram is a [BLOCK, 16] compare: 1024 with 16 warps
# keeps it at 32 values per thread, the fastest of the block x warps sweep on the H200
# (128 full rows of 16384: 79.8 us, against 103.2 us with 8 warps; measured in round 6,
# `git log -p docs/benchmarks.md`).
DEFAULT_BLOCK = 1024
DEFAULT_WARPS = 16
# The resident variant's defaults, the fastest on the H200 at widths 4096 and 16384 and
# 1 to 128 rows (against 4 and 16 warps, 4 to 8 bits; benchmarks/kernels/row_topk_latency.py).
DEFAULT_RESIDENT_WARPS = 8
DEFAULT_DIGIT_BITS = 5
DIGIT_BITS_CHOICES = (4, 5, 6, 7, 8)  # the pick packs a digit into 8 bits


RESIDENT_DEFAULTS = (1024, 4096, 8192)
"""The resident blocks the launcher picks from (see ``default_resident``)."""


def default_resident(width: int) -> int:
    """The resident block for a logits width: the smallest of ``RESIDENT_DEFAULTS`` that
    holds it; wider rows continue in re-read chunks of 8192.

    Each block is a compiled variant, and a variant first met mid-serving compiles there
    (seconds on the H200: r6-3's first dsv32-small prefill, at a new width, took 2 s with
    one variant per power of two). Three fixed blocks are few enough for graph capture and
    the engine's extend warm-up to compile all of them. A block wider than the width
    costs each pass (8192 for width 4096: ~14.5 us against ~10 us on the H200), which is
    why 4096 is one of them, the decode width of a 4k context; below 1024 a row costs
    little either way, and rows no longer than k (2048 in the model) take the unscored
    path, whose cost is the compaction. Past 8192 a whole-row block did not pay: at width
    16384 it won by up to ~7% without slots, lost by up to ~20% with them, and by 2x on
    a single short row.
    """
    for block in RESIDENT_DEFAULTS:
        if width <= block:
            return block
    return RESIDENT_DEFAULTS[-1]


def _row_topk_kernel(
    out_ptr,
    x_ptr,
    len_ptr,
    slots_ptr,
    width,
    k,
    x_stride,
    out_stride,
    slots_width,
    slots_stride,
    next_n,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    MAP_SLOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    out_row = out_ptr + row * out_stride
    if MAP_SLOTS:
        slots_row = slots_ptr + (row // next_n) * slots_stride  # the row's request
    n = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), width)
    small = n <= k  # the whole row fits: take it without reading a score
    scored = tl.where(small, 0, n)  # positions whose scores are read
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 16)
    sign = tl.full([BLOCK], 1, tl.uint32) << 31

    # Search state: digits fixed so far, how many of the k are still to be found among
    # keys matching them, and the lowest bit position fixed.
    # Scalars derive from ``n`` so their types are fixed (int32 / uint32 / bool).
    zero = n * 0
    prefix = zero.to(tl.uint32)
    need = zero + k
    shift_final = zero + 28
    done = small
    take_all = n < 0
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        # Per-lane counts, reduced once per pass rather than once per chunk. Bins go on
        # axis 0 so each thread keeps all 16 bins of its own positions (no shuffles).
        lanes = tl.zeros([16, BLOCK], tl.int32)
        for start in range(0, tl.where(done, 0, n), BLOCK):
            idx = start + offs
            ok = idx < n
            x = tl.load(x_row + idx, mask=ok, other=0.0)
            # Order-preserving uint32 key (-0.0 folded into +0.0 so they tie). Written out
            # here and in the compaction: a helper would have to be a JITFunction, which
            # freezes the interpreter mode at import like LazyKernel avoids.
            bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
            u = bits.to(tl.uint32, bitcast=True)
            key = tl.where(bits >= 0, u | sign, ~u)
            ok = ok & (x == x)  # NaN is never a candidate
            if p > 0:
                ok = ok & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            digit = tl.where(ok, ((key >> shift) & 15).to(tl.int32), 16)  # 16: no bin
            lanes += (bins[:, None] == digit[None, :]).to(tl.int32)
        counts = tl.sum(lanes, axis=1)
        if p == 0:
            # Fewer than k candidates (NaNs): take every candidate, no threshold.
            take_all = (n > k) & (tl.sum(counts, axis=0) <= k)
            done = done | take_all
        # The digit d whose bucket holds the need-th largest: above(d) < need <= above+count.
        above = tl.sum(tl.where(bins[None, :] > bins[:, None], counts[None, :], 0), axis=1)
        pick = (above < need) & (need <= above + counts)
        d = tl.sum(tl.where(pick, bins, 0), axis=0)
        a = tl.sum(tl.where(pick, above, 0), axis=0)
        c = tl.sum(tl.where(pick, counts, 0), axis=0)
        live = done == 0
        prefix = tl.where(live, prefix | (d.to(tl.uint32) << shift), prefix)
        need = tl.where(live, need - a, need)
        shift_final = tl.where(live, shift, shift_final)
        done = done | (c == need)  # the bucket is taken whole: lower bits do not matter

    # Compaction in position order. "always" entries are taken outright (above the
    # threshold; or every candidate / position when there is no threshold); "at" entries
    # (equal to the threshold) while the budget ``need`` lasts. One scan counts both:
    # always in the low 16 bits, at in the high ones (BLOCK < 2**15 keeps them apart).
    low = shift_final.to(tl.uint32)
    threshold = prefix >> low
    plain = (small | take_all) == 0
    at_seen = zero
    taken = zero
    for start in range(0, n, BLOCK):
        idx = start + offs
        in_len = idx < n
        x = tl.load(x_row + idx, mask=idx < scored, other=0.0)
        cand = in_len & (x == x)
        bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
        u = bits.to(tl.uint32, bitcast=True)
        hi = tl.where(bits >= 0, u | sign, ~u) >> low
        always = tl.where(plain, cand & (hi > threshold), tl.where(small, in_len, cand))
        at = tl.where(plain, cand & (hi == threshold), False)
        both = always.to(tl.int32) + (at.to(tl.int32) << 16)
        before = tl.cumsum(both, axis=0) - both
        at_before = at_seen + (before >> 16)
        used = tl.minimum(at_before, need) - tl.minimum(at_seen, need)
        dest = taken + (before & 0xFFFF) + used
        sel = always | (at & (at_before < need))
        keep = sel & (dest < k)
        value = idx
        if MAP_SLOTS:
            # The reference's clamp into the table (idx is never negative here), so a
            # table narrower than the logits reads its last column as torch does.
            value = tl.load(slots_row + tl.minimum(idx, slots_width - 1), mask=keep, other=-1)
        tl.store(out_row + dest, value, mask=keep)
        total = tl.sum(both, axis=0)
        taken += (
            (total & 0xFFFF) + tl.minimum(at_seen + (total >> 16), need) - tl.minimum(at_seen, need)
        )
        at_seen += total >> 16

    cols = tl.arange(0, OUT_BLOCK)
    for start in range(0, k, OUT_BLOCK):
        col = start + cols
        tl.store(out_row + col, tl.full([OUT_BLOCK], -1, tl.int32), mask=(col < k) & (col >= taken))


_row_topk = LazyKernel(_row_topk_kernel, aligned=True)


def row_topk_triton(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    next_n: int = 1,
    variant: str = "resident",
    block: int = DEFAULT_BLOCK,
    num_warps: int | None = None,
    resident: int | None = None,
    digit_bits: int = DEFAULT_DIGIT_BITS,
) -> torch.Tensor:
    """``reference_row_topk``'s result, written into ``out``, with work per row ~ its length.

    With ``slots`` (int32 ``[reqs, max_len]``, ``rows = reqs * next_n``, row stride free)
    the result is ``map_positions_to_slots`` of it instead, in the same launch.

    The rest are tuning knobs only; results do not depend on them. ``variant`` picks the
    kernel: ``"resident"`` (rows up to ``resident`` scores, a power of 2 in
    ``[16, 16384]``, default ``default_resident(width)``, stay in registers; ``digit_bits``
    in ``[4, 8]`` per radix pass) or ``"chunked"`` (``block``, a power of 2 in ``[16, 8192]``,
    scores per chunk). ``num_warps`` defaults to each variant's best on the H200.
    """
    check_row_topk(logits, lengths, k, out)
    if slots is not None:
        check_slot_map(out.shape[0], slots, next_n, logits.device)
    device = logits.device
    require_launchable(device, "cumsum")
    rows, width = logits.shape
    if variant == "chunked":
        if block < 16 or block > 8192 or block & (block - 1):
            raise ValueError(f"block must be a power of 2 in [16, 8192], got {block}")
        kernel, warps = _row_topk, DEFAULT_WARPS
        sizes = {"BLOCK": block}
        chunk = block
    elif variant == "resident":
        chunk = default_resident(width) if resident is None else resident
        if chunk not in RESIDENT_CHOICES:
            raise ValueError(f"resident must be a power of 2 in [16, 16384], got {resident}")
        if digit_bits not in DIGIT_BITS_CHOICES:
            raise ValueError(f"digit_bits must be one of {DIGIT_BITS_CHOICES}, got {digit_bits}")
        if width >= MAX_RESIDENT_WIDTH:
            raise ValueError(f"the resident variant takes widths below 2**28, got {width}")
        kernel, warps = row_topk_resident, DEFAULT_RESIDENT_WARPS
        sizes = {"RESIDENT": chunk, "DIGIT_BITS": digit_bits}
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if rows == 0:
        return out
    mapped = slots is not None
    # Unmapped, the table pointer is never read: ``out`` stands in (same dtype and
    # alignment, so it adds no compiled variant).
    table = slots if mapped else out
    kernel[(rows,)](
        out,
        logits,
        lengths,
        table,
        width,
        k,
        logits.stride(0),
        out.stride(0),
        table.shape[1] if mapped else 1,
        table.stride(0) if mapped else 0,
        next_n if mapped else 1,
        **sizes,
        OUT_BLOCK=min(chunk, max(16, triton.next_power_of_2(k))),
        MAP_SLOTS=mapped,
        num_warps=warps if num_warps is None else num_warps,
    )
    return out
