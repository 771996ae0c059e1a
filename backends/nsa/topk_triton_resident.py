"""The latency-optimised row top-k: a row's scores stay in registers across every pass.

``topk_triton``'s chunked kernel re-reads the row from memory in each of its up to eight
4-bit radix passes and the compaction, each chunk a load and a cross-warp reduction in
series. On the H200, at DeepSeek-V3.2's decode sizes (width 4096, k 2048), that is
~25 us a launch inside a graph at 16 to 128 rows alike: latency, not bandwidth, one
program per row and most SMs idle. Here a program loads its row's first ``RESIDENT``
scores once, turns them into order keys once, and runs the select and the compaction on
those registers (~10 us there; benchmarks/kernels/row_topk_latency.py):

* **Histogram digits**: each pass is one ``tl.histogram`` (warp ballots, then
  shared-memory atomics) of ``DIGIT_BITS``-bit digits, not a ``[16, BLOCK]`` compare
  and reduce per chunk. 5 bits (32 bins, one per lane of a warp, so no ballot is wasted
  on padding bins) measured fastest: Gaussian scores settle in ~2.7 passes on average;
  8 bits needs fewer passes, but each costs more than the passes it saves.
* **Invalid lanes as key 0**: key 0 is the bit pattern ``0xFFFFFFFF``, a NaN, so no
  candidate ever has it and "past the length or NaN" costs no register of its own.
* **Rows longer than RESIDENT** (the width is only known at launch, lengths only on the
  device) continue in RESIDENT-wide chunks re-read from memory after the resident one,
  behind a uniform branch a row that fits never takes: exact, and still faster than the
  chunked kernel at width 16384, so one compiled kernel serves every row.

Semantics are ``topk_ref.reference_row_topk``'s (and ``map_positions_to_slots``'s with
``MAP_SLOTS``) bit for bit, as for the chunked kernel; see ``topk_triton`` for the
compaction's rules. Grid ``(rows,)`` from shapes only: no host sync, graph-capturable.
"""

from __future__ import annotations

from backends.common.triton_kernels import LazyKernel

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    tl = None

__all__ = ["MAX_RESIDENT_WIDTH", "RESIDENT_CHOICES", "row_topk_resident"]

# Resident block sizes the launcher may ask for. The compaction packs two counts of a
# block into the halves of an int32, so a block must stay below 2**15 entries.
RESIDENT_CHOICES = tuple(2**i for i in range(4, 15))

# The pick of a pass packs (digit, count above, count in the bucket) into one int64 so
# one reduction returns all three: 8 bits of digit, then 28 bits for each count, which
# bounds the width (a 2**28-column fp32 row would be 1 GiB; no logits row comes near).
MAX_RESIDENT_WIDTH = 1 << 28


def _row_topk_resident_kernel(
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
    RESIDENT: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
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
    offs = tl.arange(0, RESIDENT)
    bins = tl.arange(0, 1 << DIGIT_BITS)

    # The one load a row that fits makes. Order-preserving key: flip the sign bit of a
    # non-negative pattern, every bit of a negative one (-0.0 folded into +0.0 first so
    # they tie); 0 for lanes past the length or NaN, which are no candidate. A row that
    # fits in k reads nothing: its lanes hold 0.0, so every position it takes has a
    # nonzero key and the compaction needs no case of its own. Written out again for the
    # re-read chunks below: a helper would have to be a JITFunction, which freezes the
    # interpreter mode at import like LazyKernel avoids.
    x = tl.load(x_row + offs, mask=offs < scored, other=0.0)
    b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    key0 = tl.where((offs < n) & (x == x), b ^ ((b >> 31) | -2147483648), 0)
    key0 = key0.to(tl.uint32, bitcast=True)

    # Search state as in the chunked kernel: digits fixed so far (``prefix``, under
    # ``fixed``), how many of the k are still to be found among keys matching them, the
    # lowest bit position fixed. The passes are a runtime loop, not unrolled: a program
    # runs its code once, so unrolled passes would each fetch their own instructions
    # cold, and instruction fetch was the unrolled kernel's top stall under ncu.
    zero = n * 0
    prefix = zero.to(tl.uint32)
    fixed = zero.to(tl.uint32)
    digit_mask = fixed + ((1 << DIGIT_BITS) - 1)
    shift = fixed + 32  # lowest bit of the pass's digit, once lowered
    need = zero + k
    shift_final = shift
    done = small
    take_all = n < 0
    for _ in range((32 + DIGIT_BITS - 1) // DIGIT_BITS):
        if done == 0:
            # A width that does not divide 32 ends on a digit at bit 0 that overlaps the
            # last one: the overlap is fixed already, so matching keys agree on it and the
            # pass just resolves the bits left.
            shift = tl.where(shift > DIGIT_BITS, shift - DIGIT_BITS, 0)
            hist = tl.zeros([1 << DIGIT_BITS], tl.int32)
            for start in range(0, n, RESIDENT):
                key = key0
                if start > 0:  # a branch, not a select: the resident chunk pays nothing
                    idx = start + offs
                    x = tl.load(x_row + idx, mask=idx < n, other=0.0)
                    b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
                    key = tl.where((idx < n) & (x == x), b ^ ((b >> 31) | -2147483648), 0)
                    key = key.to(tl.uint32, bitcast=True)
                match = (key != 0) & ((key & fixed) == prefix)
                digit = ((key >> shift) & digit_mask).to(tl.int32)
                hist += tl.histogram(digit, 1 << DIGIT_BITS, mask=match)
            # The digit d whose bucket holds the need-th largest: above(d) < need <=
            # above + count. One scan and one reduction: the pick's digit and both counts
            # come packed in an int64. The picked bucket is never empty, so no pick (fewer
            # candidates than k, NaNs: take them all, no threshold) reads as c == 0, and
            # only the first pass, with need == k, can have none.
            above = tl.cumsum(hist, axis=0, reverse=True) - hist
            pick = (above < need) & (need <= above + hist)
            packed = bins.to(tl.int64) | (above.to(tl.int64) << 8) | (hist.to(tl.int64) << 36)
            picked = tl.sum(tl.where(pick, packed, 0), axis=0)
            d = (picked & 255).to(tl.uint32)
            a = ((picked >> 8) & ((1 << 28) - 1)).to(tl.int32)
            c = (picked >> 36).to(tl.int32)
            take_all = c == 0
            live = c > 0
            prefix = tl.where(live, prefix | (d << shift), prefix)
            fixed = tl.where(live, fixed | (digit_mask << shift), fixed)
            need = tl.where(live, need - a, need)
            shift_final = tl.where(live, shift, shift_final)
            done = take_all | (c == need)  # bucket taken whole: lower bits do not matter

    # Compaction in position order: keys above the threshold are taken outright, keys at
    # it while ``need`` lasts, lowest position first; one scan counts both, above in the
    # low 16 bits, at in the high ones (RESIDENT < 2**15 keeps them apart). A row with no
    # threshold (it fits in k, or has fewer than k candidates) gets threshold 0 at bit 0:
    # "above" is then exactly its nonzero keys and "at" is empty. Exactly k entries (or
    # every candidate) are taken, so no destination reaches k.
    plain = (small | take_all) == 0
    low = tl.where(plain, shift_final, 0)
    threshold = tl.where(plain, prefix >> low, 0)
    at_seen = zero
    taken = zero
    for start in range(0, n, RESIDENT):
        idx = start + offs
        key = key0
        if start > 0:
            x = tl.load(x_row + idx, mask=idx < scored, other=0.0)
            b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
            key = tl.where((idx < n) & (x == x), b ^ ((b >> 31) | -2147483648), 0)
            key = key.to(tl.uint32, bitcast=True)
        hi = key >> low
        above = hi > threshold
        at = (hi == threshold) & (key != 0)
        both = above.to(tl.int32) + (at.to(tl.int32) << 16)
        before = tl.cumsum(both, axis=0) - both
        at_before = at_seen + (before >> 16)
        used = tl.minimum(at_before, need) - tl.minimum(at_seen, need)
        dest = taken + (before & 0xFFFF) + used
        keep = above | (at & (at_before < need))
        value = idx
        if MAP_SLOTS:
            # The reference's clamp into the table (idx is never negative here).
            value = tl.load(slots_row + tl.minimum(idx, slots_width - 1), mask=keep, other=-1)
        tl.store(out_row + dest, value, mask=keep)
        total = tl.sum(both, axis=0)
        taken += (
            (total & 0xFFFF) + tl.minimum(at_seen + (total >> 16), need) - tl.minimum(at_seen, need)
        )
        at_seen += total >> 16

    # Padding from the block holding ``taken``: a row that took all k pads nothing.
    cols = tl.arange(0, OUT_BLOCK)
    for start in range((taken // OUT_BLOCK) * OUT_BLOCK, k, OUT_BLOCK):
        col = start + cols
        tl.store(out_row + col, tl.full([OUT_BLOCK], -1, tl.int32), mask=(col < k) & (col >= taken))


row_topk_resident = LazyKernel(_row_topk_resident_kernel, aligned=True)
