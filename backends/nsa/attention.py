"""Layer-side NSA (DeepSeek-V3.2 sparse attention) decode functions that consume a plan.

A model layer calls these with the per-batch :class:`NSAPlan` the planner built once.
They only READ the plan: every piece of metadata (lengths, page table, slot map,
schedule, widths) comes from it and nothing is recomputed here -- a layer that quietly
rebuilt metadata would hide planner bugs and break CUDA-graph replay. That the plans
handed to a model are NSA plans is checked once, when the engine is built.

Plan fields used (int32 tensors unless noted; ``rows = reqs * next_n``, row
``r = req * next_n + i``):

* ``next_n``, ``kernel_next_n``, ``topk``, ``max_seq_len`` (python ints; ``max_seq_len`` is
  the logits width; ``kernel_next_n`` the rows per request deep_gemm sees: ``next_n``
  natively, 1 when the rows are expanded)
* ``kv_lens [rows]``: causal KV length of each query row
* ``page_table [reqs, pages]``: 64-token page ids
* ``kernel_page_table [kernel_reqs, pages]``: deep_gemm's block table (the page table, each
  row repeated per query row when expanded)
* ``token_slots [reqs, max_len]``: physical slot of each logical position
* ``schedule [num_sms + 1, 2]``: deep_gemm's SM schedule

``indexer_topk`` and ``sparse_mla_decode`` have static shapes and no host syncs, so they
can be captured in CUDA graphs. ``dense_mla_decode`` is a slow float64 test oracle.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from backends.deepgemm import fp8_paged_mqa_logits
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.plan import NSAPlan
from backends.nsa.sparse_mla_triton import sparse_mla_decode_triton
from backends.nsa.topk import row_topk
from planner.errors import PlanError

__all__ = [
    "check_mla_inputs",
    "dense_mla_decode",
    "indexer_topk",
    "sparse_mla",
    "sparse_mla_decode",
]


def _rows_of(kv_lens: torch.Tensor, next_n: int) -> tuple[int, int]:
    rows = kv_lens.shape[0]
    if rows % next_n != 0:
        raise PlanError(
            "rows must be a multiple of next_n",
            field="kv_lens",
            expected=f"k * {next_n}",
            actual=rows,
        )
    return rows, rows // next_n


def indexer_topk(
    plan: NSAPlan, q_fp8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor
) -> torch.Tensor:
    """The indexer's top-k: physical KV slots each query row attends to, ``int32 [rows, topk]``.

    ``q_fp8``: float8_e4m3fn ``[rows, H, D]`` (any shape with ``rows * H * D`` in that
    order); ``weights``:
    float32 ``[rows, H]`` with the query scales already folded in; ``index_cache``: the
    deep_gemm page layout (see ``backends.deepgemm.fp8``).

    Scores come from ``fp8_paged_mqa_logits`` over width ``plan.max_seq_len``; each row's
    best ``plan.topk`` of its own positions ``< kv_lens[row]`` are taken by ``row_topk``
    (length-aware: nothing past a row's length is read, deep_gemm leaves it undefined;
    a row that fits takes all its positions unscored; ties go to the lowest position) and
    mapped through ``token_slots`` of the row's request in the same call
    (``topk_ref.map_positions_to_slots``), ascending by position, ``-1`` after.
    ``max_seq_len`` must cover every ``kv_lens`` entry (positions past it can never be
    chosen; checking would need a host sync).
    """
    next_n, kernel_n = plan.next_n, plan.kernel_next_n
    topk = plan.topk
    width = plan.max_seq_len
    kv_lens = plan.kv_lens
    schedule = plan.schedule
    token_slots = plan.token_slots
    rows, _ = _rows_of(kv_lens, next_n)
    kernel_reqs = rows // kernel_n  # reqs natively, rows when expanded to one row each

    q4 = q_fp8.reshape(kernel_reqs, kernel_n, *q_fp8.shape[-2:])
    logits = fp8_paged_mqa_logits(
        q4,
        index_cache,
        weights,
        kv_lens.view(kernel_reqs, kernel_n),
        plan.kernel_page_table,
        schedule,
        width,
    )
    # Length-aware: each row's top-k over its own valid positions only (deep_gemm leaves the
    # rest undefined, so nothing past kv_lens is read), rows that fit take all theirs
    # unscored. The positions are mapped to slots in the same call (one launch on CUDA,
    # not a chain of small ops a layer); ascending by position, -1 after.
    idx = torch.empty(rows, topk, dtype=torch.int32, device=logits.device)
    return row_topk(logits, kv_lens, topk, idx, slots=token_slots, next_n=next_n)


def check_mla_inputs(
    q_nope_abs: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[int, int]:
    rows, heads, latent = q_nope_abs.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (rows, heads):
        raise PlanError(
            "q_rope must be [rows, H, rope] like q_nope_abs",
            field="q_rope",
            expected=(rows, heads, "rope"),
            actual=tuple(q_rope.shape),
        )
    rope = q_rope.shape[2]
    if kv_cache.dim() != 2 or kv_cache.shape[1] != latent + rope:
        raise PlanError(
            "kv_cache must be [num_slots, latent + rope]",
            field="kv_cache",
            expected=("num_slots", latent + rope),
            actual=tuple(kv_cache.shape),
        )
    return latent, rope


def sparse_mla_decode(
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode over the selected slots only: ``o [rows, H, latent]``.

    ``logits[h, t] = (q_nope_abs[h] . latent[s_t] + q_rope[h] . k_rope[s_t]) * scale`` for
    the slots ``s_t = topk_slots[row, t]`` (``-1`` entries ignored), softmax in fp32,
    ``o[h] = sum_t p[h, t] latent[s_t]``. ``kv_cache [num_slots, 576]`` is latent 512 |
    k_rope 64. A row with no valid slot yields zeros. Indices are clamped and masked rather
    than filtered, so shapes are static (graph-capturable on CUDA, same code on CPU).
    Output dtype follows ``q_nope_abs``.
    """
    latent, _ = check_mla_inputs(q_nope_abs, q_rope, kv_cache)
    rows = q_nope_abs.shape[0]
    if topk_slots.dim() != 2 or topk_slots.shape[0] != rows:
        raise PlanError(
            "topk_slots must be [rows, topk]",
            field="topk_slots",
            expected=(rows, "topk"),
            actual=tuple(topk_slots.shape),
        )
    valid = topk_slots >= 0  # [rows, K]
    # float64 on the CPU: a row's result must not depend on the batch or the slots' order
    acc = torch.float64 if q_nope_abs.device.type == "cpu" else torch.float32
    kv = kv_cache[topk_slots.clamp(min=0).to(torch.int64)].to(acc)  # [rows, K, 576]
    lat, k_rope = kv[..., :latent], kv[..., latent:]
    logits = torch.einsum("rhd,rkd->rhk", q_nope_abs.to(acc), lat)
    logits = (logits + torch.einsum("rhd,rkd->rhk", q_rope.to(acc), k_rope)) * softmax_scale
    mask = valid.unsqueeze(1)
    logits = logits.masked_fill(~mask, float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    p = torch.exp(logits - peak) * mask
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("rhk,rkd->rhd", p, lat)
    return out.to(q_nope_abs.dtype)


def sparse_mla(
    plan: NSAPlan | NSAExtendPlan,
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sparse MLA over the plan's rows with the kernel the plan names (``mla_kernel``).

    ``auto``: the Triton split-KV kernel on CUDA, reading the plan's split table
    (one per batch, every layer), the torch reference elsewhere. Same semantics
    as :func:`sparse_mla_decode`; bf16 results within ~1e-2 of it.
    """
    kernel = plan.mla_kernel
    if kernel == "auto":
        kernel = "triton" if q_nope_abs.is_cuda and triton_available(q_nope_abs.device) else "torch"
    if kernel == "torch":
        return sparse_mla_decode(q_nope_abs, q_rope, kv_cache, topk_slots, softmax_scale)
    rows = q_nope_abs.shape[0]
    table = plan.mla_split_plan.view(rows, plan.mla_splits + 1)
    return sparse_mla_decode_triton(
        q_nope_abs, q_rope, kv_cache, topk_slots, softmax_scale, split_plan=table
    )


def dense_mla_decode(
    plan: NSAPlan,
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Test oracle: MLA decode over ALL valid tokens of each row, in float64.

    Row ``r`` attends to positions ``< plan.kv_lens[r]`` of its request's
    ``plan.token_slots``. Written as a plain per-row loop on purpose (host syncs, not for
    graphs) so it shares no code with :func:`sparse_mla_decode`; with ``topk`` covering
    every length the two must agree.
    """
    next_n = plan.next_n
    kv_lens = plan.kv_lens
    token_slots = plan.token_slots
    latent, _ = check_mla_inputs(q_nope_abs, q_rope, kv_cache)
    rows, _ = _rows_of(kv_lens, next_n)
    out = torch.zeros(q_nope_abs.shape, dtype=torch.float64, device=q_nope_abs.device)
    lens = kv_lens.tolist()
    for r in range(rows):
        n = int(lens[r])
        if n <= 0:
            continue
        slots = token_slots[r // next_n, :n].to(torch.int64)
        kv = kv_cache[slots].double()
        lat, k_rope = kv[:, :latent], kv[:, latent:]
        logits = (q_nope_abs[r].double() @ lat.T + q_rope[r].double() @ k_rope.T) * softmax_scale
        out[r] = torch.softmax(logits, dim=-1) @ lat
    return out.to(q_nope_abs.dtype)
