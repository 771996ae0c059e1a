"""Which plan schemas an engine's planner makes, with their options, from the run config.

The layers read ``nsa``'s plans in every mode. With ``planner.mla_kernel: flashinfer`` the
planner also makes FlashInfer's sparse MLA companion plan (``nsa_flashinfer``) for the
uniform batches (decode, target verify, draft decode), and the layers run the sparse MLA
on FlashInfer's kernel there; extend and draft-extend batches keep the NSA plan's own
kernel (Triton on CUDA), which ``nsa``'s ``mla_kernel: auto`` names.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.triton_kernels import triton_available
from backends.flashinfer.wrappers import flashinfer_importable
from backends.nsa import NSADraftExtendPlan, NSAExtendPlan, NSAPlan
from backends.nsa_flashinfer import NSAFlashInferPlan
from dsv32_engine.models.model import DSV32Model
from planner.errors import ConfigError
from planner.schema import Plan

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kernel_name(mla_kernel: str, device: torch.device) -> str:
    """The sparse MLA kernel decode batches run, by name, for reports (``auto``: the NSA
    plan's own, Triton on CUDA, the torch reference elsewhere).

    ``auto`` does not take FlashInfer's kernel, though the 61-layer step with it is
    1.63-1.98x its HBM floor at B 1-128 against 1.62-2.80x with Triton: in the serving
    loop it gave no more tokens/s (dsv32-shapes, 64 requests: 1567 against 1576) and its
    ``plan()`` runs on the host every replay (644 against 248 us of planner time per
    replay; round 7, `git log -p docs/benchmarks.md`)."""
    if mla_kernel != "auto":
        return mla_kernel
    return "triton" if device.type == "cuda" and triton_available(device) else "torch"


INVARIANT_MLA_SPLITS = 4
"""Sparse MLA splits of every row in the batch-invariant mode (``nsa.mla_fixed_splits``):
the boundaries then follow only the row's own top-k length, never the batch's row count.
Four keep a lone decode row's 2,048 top-k tokens over four programs per head group (the
wave model gives it 32) while bounding the split workspace of a 2,048-token prompt chunk
(rows x splits x heads x 513 float32: 2.15 GB at DeepSeek-V3.2's 128 heads; the wave model
gives such chunks one split and no workspace)."""


def plan_schemas(
    mla_kernel: str,
    schedule_layout: str,
    model: DSV32Model,
    device: torch.device,
    *,
    batch_invariant: bool = False,
) -> tuple[list[type[Plan]], dict[str, dict[str, Any]], dict[str, tuple[type[Plan], ...]]]:
    """``(schemas, options, needs)``: what the planner makes, its backend options, and the
    plan classes the model's layers must be handed (for ``Planner.check_serves``).

    ``batch_invariant`` plans each row independently of its batch: a fixed split count per
    row, and verify rows expanded into decode-shaped rows (deep_gemm's native ``next_n = 2``
    kernel is another variant than decode's, so a verify row would round otherwise)."""
    flashinfer = mla_kernel == "flashinfer"
    nsa: dict[str, Any] = {
        "topk": model.config.index_topk,
        "schedule_layout": schedule_layout,
        "mla_heads": model.attention_heads,  # this rank's, head-sharded
        "mla_kernel": "auto" if flashinfer else mla_kernel,
    }
    if batch_invariant:
        nsa |= {"mla_fixed_splits": INVARIANT_MLA_SPLITS, "native_next_n": ()}
    options: dict[str, dict[str, Any]] = {"nsa": nsa}
    schemas: list[type[Plan]] = [NSAPlan, NSAExtendPlan, NSADraftExtendPlan]
    needs = dict(type(model).PLANS)
    if flashinfer:
        if device.type == "cuda" and not flashinfer_importable():
            raise ConfigError(
                "mla_kernel flashinfer needs flashinfer-python importable on this machine "
                "(without it every layer would run the torch reference sparse MLA)",
                field="planner.mla_kernel",
                expected="auto / triton, or install flashinfer-python (the gpu extra)",
                actual="flashinfer",
            )
        options["nsa_flashinfer"] = flashinfer_options(model, device)
        schemas.append(NSAFlashInferPlan)
        needs |= type(model).OPTIONAL_PLANS
    return schemas, options, needs


def flashinfer_options(model: DSV32Model, device: torch.device) -> dict[str, Any]:
    """``nsa_flashinfer``'s options for ``model``: its top-k, heads (this rank's), softmax
    scale and dtype, so FlashInfer is planned for exactly what the layers run."""
    cfg = model.config
    sparse: dict[str, Any] = {
        "sparse_topk": cfg.index_topk,
        "sparse_heads": model.attention_heads,
        "sparse_sm_scale": cfg.softmax_scale,
    }
    dtype = _DTYPE_NAMES.get(model.dtype)
    if dtype is not None:
        sparse |= {"sparse_q_dtype": dtype, "sparse_kv_dtype": dtype}
    elif device.type == "cuda":
        raise ConfigError(
            "FlashInfer's MLA kernel takes bfloat16 or float16 queries and KV",
            field="planner.mla_kernel",
            expected="a bfloat16 or float16 model, or mla_kernel auto / triton",
            actual=str(model.dtype),
        )
    return sparse
