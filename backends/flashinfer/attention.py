"""Layer-side FlashInfer attention over a plan: FlashInfer's ``run`` on GPU, a reference elsewhere.

Layers only read the plan. With FlashInfer, the wrapper the ``flashinfer_plan``
host op planned for this very plan runs: the plan carries its handle
(captured plans: the graph wrapper of that size; eager plans: the eager
wrapper, refused if a newer eager plan re-planned it since). Without FlashInfer the torch references below read the same plan fields
(``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` or ``kv_len_arr``, the
scalars), so a wrong field fails the CPU tests, not the first GPU run.

The references have static shapes (every request is read to the page
capacity of the plan and masked), so they also run under graph capture.
Rows are ``reqs * next_n`` query tokens, request-major; row ``i`` of a request
with KV length ``L`` attends to the first ``L - (next_n - 1 - i)`` tokens,
which is FlashInfer's causal alignment (queries at the end of the KV).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backends.flashinfer.plans import FlashInferDecodePlan, FlashInferMLAPlan
from backends.flashinfer.wrappers import PlanSlot, flashinfer_importable
from planner.errors import PlanError

FlashInferPlan = FlashInferDecodePlan | FlashInferMLAPlan

__all__ = [
    "flashinfer_decode_attention",
    "flashinfer_mla_attention",
    "reference_decode_attention",
    "reference_mla_attention",
]

IMPLS = ("auto", "flashinfer", "reference")


def _slot(plan: FlashInferPlan, impl: str, device: torch.device, kind: str) -> PlanSlot | None:
    """The planned wrapper to run, or None for the reference; refuses silent fallbacks on GPU."""
    if impl not in IMPLS:
        raise PlanError(
            "unknown attention implementation", field="impl", expected=IMPLS, actual=impl
        )
    if impl == "reference":
        return None
    handle = plan.wrapper
    slot = handle.slot if handle is not None and handle.current else None
    if slot is not None and slot.config.kind != kind:
        raise PlanError(
            "plan was made for another FlashInfer kernel",
            field="plan",
            expected=kind,
            actual=slot.config.kind,
        )
    if slot is not None and slot.wrapper is not None:
        return slot
    wanted = impl == "flashinfer" or (
        device.type == "cuda" and flashinfer_importable() and slot is None
    )
    if wanted:
        raise PlanError(
            "no FlashInfer wrapper is planned for this plan: the flashinfer_plan host op did not run "
            "for it, or a newer eager plan replaced it (plan again, or pass impl='reference')",
            field="plan_info",
        )
    return None


def _check_rows(plan: FlashInferPlan, rows: int) -> int:
    reqs = plan.kv_indptr.shape[0] - 1
    next_n = int(plan.next_n)
    if rows != reqs * next_n:
        raise PlanError(
            "query rows do not match the plan", field="q", expected=reqs * next_n, actual=rows
        )
    return next_n


def _page_grid(plan: FlashInferPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's page ids ``[reqs, width]`` (0 past its list) and page counts ``[reqs]``."""
    indptr = plan.kv_indptr
    flat = plan.kv_indices
    reqs = indptr.shape[0] - 1
    width = flat.shape[0] // max(reqs, 1)
    page = torch.arange(width, device=flat.device)
    count = (indptr[1:] - indptr[:-1]).to(torch.int64)
    idx = (indptr[:-1, None].to(torch.int64) + page).clamp(max=max(flat.shape[0] - 1, 0))
    pages = flat[idx]
    return torch.where(page < count[:, None], pages, torch.zeros_like(pages)), count


def _tokens(pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, offset) of every logical token position ``[reqs, width * page_size]``."""
    t = torch.arange(pages.shape[1] * page_size, device=pages.device)
    return pages[:, t // page_size].to(torch.int64), (t % page_size).expand(pages.shape[0], -1)


def _row_mask(kv_lens: torch.Tensor, next_n: int, width: int) -> torch.Tensor:
    """``[reqs, next_n, width]``: position t is visible to draft token i (causal at the end)."""
    back = torch.arange(next_n - 1, -1, -1, device=kv_lens.device)
    limit = kv_lens.to(torch.int64)[:, None] - back[None, :]
    return torch.arange(width, device=kv_lens.device)[None, None, :] < limit[:, :, None]


def _softmax_rows(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``logits [reqs, n, H, T]`` restricted to ``visible [reqs, n, T]``."""
    return torch.softmax(logits.masked_fill(~visible[:, :, None, :], float("-inf")), dim=-1)


def reference_decode_attention(
    plan: FlashInferDecodePlan, q: torch.Tensor, kv_cache: Any
) -> torch.Tensor:
    """Paged attention as FlashInfer's decode computes it, in fp32, from the plan's fields.

    ``q [rows, H, D]``; ``kv_cache``: ``(k, v)`` each ``[pages, page_size, Hkv, D]``
    or one ``[pages, 2, page_size, Hkv, D]`` tensor (FlashInfer's NHD layouts).
    KV length per request: ``(pages - 1) * page_size + kv_last_page_len``.
    """
    next_n = _check_rows(plan, q.shape[0])
    k_cache, v_cache = kv_cache if isinstance(kv_cache, (tuple, list)) else kv_cache.unbind(1)
    page_size = int(plan.page_size)
    if k_cache.shape[1] != page_size:
        raise PlanError(
            "cache pages differ from the plan's",
            field="kv_cache",
            expected=page_size,
            actual=k_cache.shape[1],
        )
    pages, count = _page_grid(plan)
    kv_lens = (count - 1) * page_size + plan.kv_last_page_len.to(torch.int64)
    page_of, offset = _tokens(pages, page_size)
    keys = k_cache[page_of, offset].float()  # [reqs, T, Hkv, D]
    values = v_cache[page_of, offset].float()
    reqs, heads, dim = pages.shape[0], q.shape[1], q.shape[2]
    kv_heads = keys.shape[2]
    scale = plan.sm_scale
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    # Query head h reads KV head h // group (GQA); grouping avoids copying KV per query head.
    qr = q.float().view(reqs, next_n, kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("rnkgd,rtkd->rnkgt", qr, keys).reshape(reqs, next_n, heads, -1) * scale
    probs = _softmax_rows(logits, _row_mask(kv_lens, next_n, keys.shape[1]))
    probs = probs.view(reqs, next_n, kv_heads, heads // kv_heads, -1)
    return torch.einsum("rnkgt,rtkd->rnkgd", probs, values).reshape(q.shape).to(q.dtype)


def reference_mla_attention(
    plan: FlashInferMLAPlan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
) -> torch.Tensor:
    """Absorbed MLA as FlashInfer's MLA kernel computes it, in fp32, from the plan's fields.

    ``q_nope [rows, H, 512]``, ``q_pe [rows, H, 64]``, ``ckv_cache [pages, page_size, 512]``,
    ``kpe_cache [pages, page_size, 64]``; ``logits = (q_nope . ckv + q_pe . kpe) * sm_scale``,
    ``out = softmax(logits) . ckv`` over the first ``kv_len_arr[r]`` tokens (causal for verify).
    """
    next_n = _check_rows(plan, q_nope.shape[0])
    page_size = int(plan.page_size)
    if ckv_cache.shape[1] != page_size or kpe_cache.shape[1] != page_size:
        raise PlanError(
            "cache pages differ from the plan's",
            field="ckv_cache",
            expected=page_size,
            actual=ckv_cache.shape[1],
        )
    pages, _ = _page_grid(plan)
    page_of, offset = _tokens(pages, page_size)
    latent, rope = (
        ckv_cache[page_of, offset].float(),
        kpe_cache[page_of, offset].float(),
    )  # [R, T, *]
    reqs, heads = pages.shape[0], q_nope.shape[1]
    qn = q_nope.float().view(reqs, next_n, heads, -1)
    qp = q_pe.float().view(reqs, next_n, heads, -1)
    logits = torch.einsum("rnhd,rtd->rnht", qn, latent) + torch.einsum("rnhd,rtd->rnht", qp, rope)
    logits = logits * float(plan.sm_scale)
    probs = _softmax_rows(logits, _row_mask(plan.kv_len_arr, next_n, latent.shape[1]))
    return torch.einsum("rnht,rtd->rnhd", probs, latent).reshape(q_nope.shape).to(q_nope.dtype)


def flashinfer_decode_attention(
    plan: FlashInferDecodePlan, q: torch.Tensor, kv_cache: Any, *, impl: str = "auto"
) -> torch.Tensor:
    """Decode attention for one layer: ``[rows, H, D]``; see the module docstring for ``impl``."""
    slot = _slot(plan, impl, q.device, "decode")
    if slot is None:
        return reference_decode_attention(plan, q, kv_cache)
    _check_rows(plan, q.shape[0])
    return slot.wrapper.run(q, kv_cache)


def flashinfer_mla_attention(
    plan: FlashInferMLAPlan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Absorbed MLA attention for one layer: ``[rows, H, 512]``; see the module docstring."""
    slot = _slot(plan, impl, q_nope.device, "mla")
    if slot is None:
        return reference_mla_attention(plan, q_nope, q_pe, ckv_cache, kpe_cache)
    _check_rows(plan, q_nope.shape[0])
    return slot.wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)
