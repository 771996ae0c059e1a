"""The extend indexer's gather and slot selection, one Triton launch each, for CUDA tensors.

``indexer_topk_extend`` (``extend_attention``) wraps deep_gemm's ``fp8_mqa_logits`` and the
top-k in two memory passes per layer, which its torch form spends a dozen kernels on:

- **Gather.** The requests' index keys, flat (``kv_slots``), for the logits kernel. Under a
  graph ``kv_slots`` is as long as the bucket's KV bound (``Limits.kv_token_capacity``),
  not the batch's KV: the torch gather moved every entry of the bound, 4x the real KV in
  issue 37's mixed steps. Here the batch's own count (``kv_indptr[-1]``, on the device)
  bounds the work: programs past it return at once. Entries past it are left as they were;
  no score range reaches them (``kv_ranges`` end at ``kv_indptr[-1]``).
- **Selection.** Each token's attended slots, ``int32 [tokens, topk]``: the scored
  tokens' ``slots[ks + best]``, the others' first ``topk_lens`` slots of their range, -1
  past them. The torch form is about twelve kernels over ``[tokens, topk]`` (int64
  offsets, two gathers, three ``where``), and under a graph it runs both branches for
  every token; here one pass reads ``best`` once and writes the result once.

Each is exact (integer copies and selections): the torch forms in ``extend_attention``
are their references, and tests compare them on random inputs, under
``TRITON_INTERPRET=1`` on the CPU and compiled on the GPU. Sizes are unspecialised
(``LazyKernel``), so a new batch never compiles; nothing is read back to the host, so a
CUDA graph captures both.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["gather_index_keys_triton", "select_slots_triton"]

_GATHER_ROWS = 64
"""Flat KV entries per gather program: 8 KB of keys at D = 128."""
_SELECT_BLOCK = 1024
"""Columns per selection program (top-k is 2048 in the model: two programs a token)."""


def _gather_kernel(
    keys_ptr,
    scales_ptr,
    words_ptr,
    page_scales_ptr,
    slots_ptr,
    count_ptr,
    n,
    page_words,
    page_scale_stride,
    WORDS: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Grid: blocks of ROWS flat entries over the static length n; the batch's own count
    # (a device scalar) ends the work, so a graph sized by the KV bound moves only the KV.
    count = tl.minimum(tl.load(count_ptr).to(tl.int64), n)
    first = tl.program_id(0).to(tl.int64) * ROWS
    if first >= count:
        return
    rows = first + tl.arange(0, ROWS)
    live = rows < count
    slot = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)
    page = slot // PAGE
    at = slot - page * PAGE
    cols = tl.arange(0, WORDS)
    src = words_ptr + (page * page_words + at * WORDS)[:, None] + cols[None, :]
    word = tl.load(src, mask=live[:, None], other=0)
    tl.store(keys_ptr + rows[:, None] * WORDS + cols[None, :], word, mask=live[:, None])
    scale = tl.load(page_scales_ptr + page * page_scale_stride + at, mask=live, other=0.0)
    tl.store(scales_ptr + rows, scale, mask=live)


def _select_kernel(
    out_ptr,
    slots_ptr,
    ks_ptr,
    kv_lens_ptr,
    topk_lens_ptr,
    best_ptr,
    last,
    topk,
    HAS_BEST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid: (column blocks, tokens). A token whose KV exceeds top-k takes its scored
    # offsets; any other its first topk_lens slots in position order.
    t = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < topk
    ks = tl.load(ks_ptr + t).to(tl.int64)
    offset = cols.to(tl.int64)
    keep = cols < tl.load(topk_lens_ptr + t)
    if HAS_BEST:  # a compile-time branch; the token's own is a select (no row of best read)
        scored = (cols * 0 + tl.load(kv_lens_ptr + t)) > topk  # per column: a block mask
        best = tl.load(best_ptr + t * topk + cols, mask=inside & scored, other=-1)
        keep = tl.where(scored, best >= 0, keep)
        offset = tl.where(scored, tl.maximum(best, 0).to(tl.int64), offset)
    flat = tl.minimum(ks + offset, last)
    slot = tl.load(slots_ptr + flat, mask=inside & keep, other=-1)
    tl.store(out_ptr + t * topk + cols, tl.where(keep, slot, -1), mask=inside)


_gather = LazyKernel(_gather_kernel)
_select = LazyKernel(_select_kernel)


def gather_index_keys_triton(
    words: torch.Tensor,
    page_scales: torch.Tensor,
    slots: torch.Tensor,
    count: torch.Tensor,
    keys: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Entries ``[0, min(count, N))`` of ``keys [N, W]`` and ``scales [N]``: the key words
    and scale of each flat entry's slot. ``words [pages, 64, W]`` is the index cache's key
    view as integer words (any page stride, rows contiguous), ``page_scales [pages, 64]``
    its fp32 scales (rows contiguous), ``slots [N]`` int32, ``count`` a one-element int32
    device tensor. Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    require_launchable(keys.device, "minimum")
    n, width = keys.shape
    if n == 0:
        return
    page = words.shape[1]
    _gather.launch(
        (triton.cdiv(n, _GATHER_ROWS),),
        keys,
        scales,
        words,
        page_scales,
        slots,
        count,
        n,
        words.stride(0),
        page_scales.stride(0),
        WORDS=width,
        PAGE=page,
        ROWS=_GATHER_ROWS,
    )


def select_slots_triton(
    slots: torch.Tensor,
    ks: torch.Tensor,
    kv_lens: torch.Tensor,
    topk_lens: torch.Tensor,
    best: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """``int32 [tokens, topk]``: see the module docstring (``best`` None: no token is
    scored, every one takes its first ``topk_lens`` slots). All int32 and contiguous."""
    require_launchable(slots.device, "maximum")
    tokens = ks.shape[0]
    out = torch.empty(tokens, topk, dtype=torch.int32, device=slots.device)
    if tokens == 0 or topk == 0:
        return out
    block = min(_SELECT_BLOCK, triton.next_power_of_2(topk))
    _select.launch(
        (triton.cdiv(topk, block), tokens),
        out,
        slots,
        ks,
        kv_lens,
        topk_lens,
        ks if best is None else best,
        slots.shape[0] - 1,
        topk,
        HAS_BEST=best is not None,
        BLOCK=block,
    )
    return out
