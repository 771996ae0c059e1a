"""The NSA FlashInfer plan: FlashInfer's MLA kernel planned once per batch over the top-k.

A companion of the NSA plan, not a replacement: the indexer still reads ``nsa``'s plan
and picks each row's slots; this plan only says how FlashInfer's MLA kernel reads those
slots. Row ``r``'s list is ``[r * topk, (r + 1) * topk)`` of the slot's index buffer,
``kv_len[r] = min(kv_len_r, topk)`` long: the same in all 61 layers, so one
``plan()`` (the ``nsa_flashinfer_plan`` host op, skipped when the lengths did not change)
serves every layer, and each layer only writes its own slots into the buffer.

It plans the target model's uniform batches (decode, target verify, idle). Extend and
draft batches have no companion plan and run the NSA plan's own sparse MLA kernel.
The fields that also exist in ``nsa`` (``kv_lens``, ``kv_len`` = ``topk_lens``) are
computed once and read by both: the planner shares fields that compute the same thing.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from backends.common.inputs import BatchInputsPlan
from backends.flashinfer.ops import dtype_named
from backends.flashinfer.plans import check_positive_int, check_scale
from backends.nsa.plan import topk_lens_field
from backends.nsa_flashinfer import ops as _ops  # noqa: F401  (registers nsa_flashinfer_plan)
from backends.paged.plan import causal_kv_lens_field
from planner.errors import SchemaError
from planner.schema import (
    PAD_DERIVED,
    Handle,
    Setting,
    Tensor,
    handle_field,
    scalar_field,
    tensor_field,
)

I32 = torch.int32
BACKENDS = ("auto", "fa2", "fa3")


class NSAFlashInferPlan(BatchInputsPlan, backend="nsa_flashinfer"):
    """What FlashInfer's MLA kernel reads over the indexer's top-k slots, and its wrapper."""

    defaults: ClassVar[dict[str, Any]] = {
        "sparse_topk": 2048,
        "sparse_heads": 128,
        "sparse_latent": 512,
        "sparse_rope": 64,
        "sparse_q_dtype": "bfloat16",
        "sparse_kv_dtype": "bfloat16",
        "sparse_sm_scale": 1.0 / math.sqrt(192),  # DeepSeek: qk head dim 128 nope + 64 rope
        "sparse_workspace_mb": 128,
        "sparse_backend": "auto",
    }

    kv_lens: Tensor = causal_kv_lens_field()
    kv_len: Tensor = topk_lens_field(
        "sparse_topk", "slots FlashInfer reads per row: min(kv_len, topk) (nsa's topk_lens)"
    )
    kv_indptr: Tensor = tensor_field(
        I32,
        ("rows+1",),
        op="uniform_offsets",
        params={"step": Setting("sparse_topk")},
        pad=PAD_DERIVED,
        doc="start of each row's slot list in the index buffer: r * topk (static)",
    )
    plan_info: Tensor = tensor_field(
        torch.int64,
        (4,),
        op="nsa_flashinfer_plan",
        inputs=("seq_lens_cpu", "kv_indptr"),
        binds=("kv_indptr",),
        params={
            "topk": Setting("sparse_topk"),
            "next_n": Setting("next_n"),
            "heads": Setting("sparse_heads"),
            "latent": Setting("sparse_latent"),
            "rope": Setting("sparse_rope"),
            "q_dtype": Setting("sparse_q_dtype"),
            "kv_dtype": Setting("sparse_kv_dtype"),
            "sm_scale": Setting("sparse_sm_scale"),
            "workspace_mb": Setting("sparse_workspace_mb"),
            "backend": Setting("sparse_backend"),
        },
        pad=PAD_DERIVED,
        doc="what FlashInfer was planned with: [rows, real rows, top-k tokens, longest] (host op)",
    )
    wrapper: Handle = handle_field("plan_info", doc="the slot (wrapper + index buffer) planned")
    topk: int = scalar_field("sparse_topk", doc="slots each row's list holds, at most")
    next_n: int = scalar_field("next_n", doc="query rows per request")
    sm_scale: float = scalar_field(
        "sparse_sm_scale", doc="softmax scale FlashInfer was planned with"
    )

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """What FlashInfer's MLA kernels accept; refused when the planner is built."""
        b = "nsa_flashinfer"
        for name in ("sparse_topk", "sparse_heads", "sparse_workspace_mb"):
            check_positive_int(settings, name, b)
        if (settings["sparse_latent"], settings["sparse_rope"]) != (512, 64):
            raise SchemaError(
                "FlashInfer's MLA kernels are built for DeepSeek's 512 latent + 64 rope dims",
                field=f"{b}.sparse_latent",
                expected=(512, 64),
                actual=(settings["sparse_latent"], settings["sparse_rope"]),
            )
        dtype_named(settings["sparse_q_dtype"], field=f"{b}.sparse_q_dtype")
        dtype_named(settings["sparse_kv_dtype"], field=f"{b}.sparse_kv_dtype")
        check_scale(settings["sparse_sm_scale"], f"{b}.sparse_sm_scale", optional=False)
        if settings["sparse_backend"] not in BACKENDS:
            raise SchemaError(
                "unknown FlashInfer MLA backend",
                field=f"{b}.sparse_backend",
                expected=BACKENDS,
                actual=settings["sparse_backend"],
            )
