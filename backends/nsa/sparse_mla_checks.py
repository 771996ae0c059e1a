"""Argument checks of the Triton sparse MLA decode launcher.

Shapes, dtypes, strides and devices only -- never tensor values, which would need a host
sync and break CUDA-graph capture. Every refusal is a ``PlanError`` naming the argument,
so a bad call is diagnosable before any kernel runs.
"""

from __future__ import annotations

import torch

from planner.errors import PlanError

__all__ = ["check_inputs", "check_out", "check_workspace", "strides8"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(field: str, message: str, expected: object, actual: object) -> PlanError:
    return PlanError(message, field=field, expected=expected, actual=actual)


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def strides8(t: torch.Tensor, field: str) -> tuple[int, int]:
    """The row and head strides of a ``[rows, H, D]`` tensor, divided by 8."""
    if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8:
        raise _fail(
            field,
            "needs a unit last stride and row/head strides that are multiples of 8 elements"
            " (16-byte aligned vector loads)",
            "stride (8a, 8b, 1)",
            tuple(t.stride()),
        )
    return t.stride(0) // 8, t.stride(1) // 8


def check_inputs(
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    split_plan: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    if q_nope_abs.dim() != 3 or q_nope_abs.dtype not in DTYPES:
        raise _fail(
            "q_nope_abs",
            "must be [rows, H, latent] in bf16, fp16 or fp32",
            "[rows, H, latent]",
            f"{q_nope_abs.dtype} {tuple(q_nope_abs.shape)}",
        )
    rows, heads, latent = q_nope_abs.shape
    dtype, device = q_nope_abs.dtype, q_nope_abs.device
    if not _pow2_at_least_16(latent):
        raise _fail("q_nope_abs", "latent must be a power of two >= 16", "16, 32, ...", latent)
    if q_rope.dim() != 3 or tuple(q_rope.shape[:2]) != (rows, heads) or q_rope.dtype != dtype:
        raise _fail(
            "q_rope",
            "must be [rows, H, rope] in q_nope_abs's dtype",
            f"{dtype} ({rows}, {heads}, rope)",
            f"{q_rope.dtype} {tuple(q_rope.shape)}",
        )
    rope = q_rope.shape[2]
    if not _pow2_at_least_16(rope):
        raise _fail("q_rope", "rope must be a power of two >= 16", "16, 32, ...", rope)
    if kv_cache.dim() != 2 or kv_cache.shape[1] != latent + rope or kv_cache.dtype != dtype:
        raise _fail(
            "kv_cache",
            "must be [num_slots, latent + rope] in q_nope_abs's dtype",
            f"{dtype} (num_slots, {latent + rope})",
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}",
        )
    if kv_cache.stride(1) != 1 or kv_cache.stride(0) % 8:
        raise _fail(
            "kv_cache",
            "rows must be contiguous with a stride that is a multiple of 8 elements",
            "stride (8k, 1)",
            tuple(kv_cache.stride()),
        )
    if (
        topk_slots.dtype != torch.int32
        or topk_slots.dim() != 2
        or topk_slots.shape[0] != rows
        or (topk_slots.shape[1] > 1 and topk_slots.stride(1) != 1)
    ):
        raise _fail(
            "topk_slots",
            "must be int32 [rows, topk] with contiguous rows",
            f"int32 ({rows}, topk)",
            f"{topk_slots.dtype} {tuple(topk_slots.shape)} stride {tuple(topk_slots.stride())}",
        )
    if (
        split_plan.dtype != torch.int32
        or split_plan.dim() != 2
        or split_plan.shape[0] != rows
        or split_plan.shape[1] < 2
        or not split_plan.is_contiguous()
    ):
        raise _fail(
            "split_plan",
            "must be a contiguous int32 [rows, splits + 1] with splits >= 1",
            f"int32 ({rows}, splits + 1)",
            f"{split_plan.dtype} {tuple(split_plan.shape)}",
        )
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache), ("topk_slots", topk_slots)):
        if t.device != device:
            raise _fail(name, "must be on q_nope_abs's device", str(device), str(t.device))
    if split_plan.device != device:
        raise _fail(
            "split_plan", "must be on q_nope_abs's device", str(device), str(split_plan.device)
        )
    return rows, heads, latent, rope, split_plan.shape[1] - 1


def check_out(out: torch.Tensor, q_nope_abs: torch.Tensor) -> None:
    if (
        out.shape != q_nope_abs.shape
        or out.dtype != q_nope_abs.dtype
        or out.device != q_nope_abs.device
    ):
        raise _fail(
            "out",
            "must match q_nope_abs in shape, dtype and device",
            f"{q_nope_abs.dtype} {tuple(q_nope_abs.shape)}",
            f"{out.dtype} {tuple(out.shape)}",
        )


def check_workspace(workspace: torch.Tensor, need: int, device: torch.device) -> None:
    if (
        workspace.dtype != torch.float32
        or workspace.dim() != 1
        or not workspace.is_contiguous()
        or workspace.numel() < need
        or workspace.device != device
    ):
        raise _fail(
            "workspace",
            "must be a contiguous fp32 vector on q's device, at least workspace_numel() long",
            f"float32 [>= {need}]",
            f"{workspace.dtype} {tuple(workspace.shape)} on {workspace.device}",
        )
