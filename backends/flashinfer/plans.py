"""FlashInfer plan schemas: paged decode (MHA/GQA) and DeepSeek MLA.

Both describe KV as FlashInfer does: a ragged page list (``kv_indptr`` into a
flat ``kv_indices``) over pages of ``limits.page_size`` tokens. The flat list
is declared over ``req_pages`` (requests x pages per request), so a captured
plan's list is a prefix of one static buffer whose capacity covers the
longest request in every row, and FlashInfer's CUDA-graph wrapper can be
bound to it once. The ``plan_info`` field is produced by the host op that
plans FlashInfer's wrapper; everything else is computed on the device.

Scalars that come from settings use backend-specific names
(``decode_sm_scale``, ``mla_sm_scale``) because the planner resolves plan
scalars from the settings of all backends merged.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from backends.common.inputs import BatchInputsPlan
from backends.flashinfer.ops import dtype_named
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

__all__ = ["FlashInferDecodePlan", "FlashInferMLAPlan"]


# Op fields both schemas share; functions, so each schema gets its own field objects.


def _qo_indptr() -> Any:
    return tensor_field(
        I32,
        ("reqs+1",),
        op="uniform_offsets",
        params={"step": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="query offsets per request (next_n tokens each)",
    )


def _kv_pages() -> Any:
    return tensor_field(
        I32,
        ("reqs",),
        op="pages_per_request",
        inputs=("seq_lens",),
        params={"page_size": Setting("page_size")},
        pad=PAD_DERIVED,
        doc="pages per request; padding requests hold one (the null page)",
    )


def _kv_indptr() -> Any:
    return tensor_field(
        I32,
        ("reqs+1",),
        op="cumsum_with_zero",
        inputs=("kv_pages",),
        pad=PAD_DERIVED,
        doc="offsets of each request's pages in kv_indices",
    )


def _kv_indices() -> Any:
    return tensor_field(
        I32,
        ("req_pages",),
        op="paged_kv_indices",
        inputs=("req_to_token", "req_pool_indices", "kv_indptr"),
        params={"page_size": Setting("page_size")},
        pad=0,
        doc="flat page ids: request r's pages at [kv_indptr[r], kv_indptr[r+1]); 0 past the end",
    )


_PLAN_INPUTS = ("seq_lens_cpu", "qo_indptr", "kv_indptr", "kv_indices")


def _binds(*names: str) -> tuple[str, ...]:
    """The host op only binds FlashInfer's buffers to these fields, never reads them: their ops
    stay inside the CUDA graph instead of being hoisted into ``replay()``."""
    return ("qo_indptr", "kv_indptr", "kv_indices", *names)


def check_positive_int(settings: dict[str, Any], name: str, field: str) -> int:
    value = settings[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SchemaError(
            "must be a positive int", field=f"{field}.{name}", expected=">= 1", actual=value
        )
    return value


def check_scale(value: Any, field: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SchemaError(
            "softmax scale must be a positive finite number", field=field, actual=value
        )


class FlashInferDecodePlan(BatchInputsPlan, backend="flashinfer_decode"):
    """What FlashInfer's paged decode (MHA/GQA) reads per layer, and its wrapper's plan."""

    defaults: ClassVar[dict[str, Any]] = {
        "num_qo_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "q_dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "decode_sm_scale": None,  # None: 1 / sqrt(head_dim), FlashInfer's default
        "use_tensor_cores": False,
        "workspace_mb": 128,
    }

    qo_indptr: Tensor = _qo_indptr()
    kv_pages: Tensor = _kv_pages()
    kv_indptr: Tensor = _kv_indptr()
    kv_indices: Tensor = _kv_indices()
    kv_last_page_len: Tensor = tensor_field(
        I32,
        ("reqs",),
        op="last_page_len",
        inputs=("seq_lens",),
        params={"page_size": Setting("page_size")},
        pad=PAD_DERIVED,
        doc="tokens in each request's last page, in [1, page_size]",
    )
    plan_info: Tensor = tensor_field(
        torch.int64,
        (4,),
        op="flashinfer_plan",
        inputs=(*_PLAN_INPUTS, "kv_last_page_len"),
        binds=_binds("kv_last_page_len"),
        params={
            "kind": "decode",
            "page_size": Setting("page_size"),
            "next_n": Setting("next_n"),
            "heads": Setting("num_qo_heads"),
            "kv_heads": Setting("num_kv_heads"),
            "head_dim": Setting("head_dim"),
            "q_dtype": Setting("q_dtype"),
            "kv_dtype": Setting("kv_dtype"),
            "sm_scale": Setting("decode_sm_scale"),
            "use_tensor_cores": Setting("use_tensor_cores"),
            "workspace_mb": Setting("workspace_mb"),
        },
        pad=PAD_DERIVED,
        doc="what FlashInfer was planned with: [requests, pages, tokens, longest] (host op)",
    )
    wrapper: Handle = handle_field("plan_info", doc="the FlashInfer wrapper planned for this plan")
    max_seq_len: int = scalar_field("max_len", doc="longest KV length the kernels must handle")
    next_n: int = scalar_field("next_n", doc="query tokens per request")
    page_size: int = scalar_field("page_size", doc="tokens per KV page")
    sm_scale: float | None = scalar_field(
        "decode_sm_scale", doc="softmax scale; None is 1/sqrt(head_dim)"
    )

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """What FlashInfer's decode kernels accept; refused when the planner is built."""
        b = "flashinfer_decode"
        heads = check_positive_int(settings, "num_qo_heads", b)
        kv_heads = check_positive_int(settings, "num_kv_heads", b)
        if heads % kv_heads:
            raise SchemaError(
                "query heads must be a multiple of KV heads",
                field=f"{b}.num_qo_heads",
                actual=(heads, kv_heads),
            )
        if settings["head_dim"] not in (64, 128, 256):
            raise SchemaError(
                "unsupported head_dim",
                field=f"{b}.head_dim",
                expected=(64, 128, 256),
                actual=settings["head_dim"],
            )
        dtype_named(settings["q_dtype"], field=f"{b}.q_dtype")
        dtype_named(settings["kv_dtype"], field=f"{b}.kv_dtype", kv=True)
        check_scale(settings["decode_sm_scale"], f"{b}.decode_sm_scale", optional=True)
        if not isinstance(settings["use_tensor_cores"], bool):
            raise SchemaError(
                "must be a bool", field=f"{b}.use_tensor_cores", actual=settings["use_tensor_cores"]
            )
        check_positive_int(settings, "workspace_mb", b)


class FlashInferMLAPlan(BatchInputsPlan, backend="flashinfer_mla"):
    """What FlashInfer's MLA kernel (DeepSeek: 512 latent + 64 rope) reads, and its wrapper's plan."""

    defaults: ClassVar[dict[str, Any]] = {
        "num_heads": 16,
        "head_dim_ckv": 512,
        "head_dim_kpe": 64,
        "q_dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "mla_sm_scale": 1.0 / math.sqrt(192),  # DeepSeek: qk head dim 128 nope + 64 rope
        "workspace_mb": 128,
        "mla_backend": "auto",
    }

    qo_indptr: Tensor = _qo_indptr()
    kv_pages: Tensor = _kv_pages()
    kv_indptr: Tensor = _kv_indptr()
    kv_indices: Tensor = _kv_indices()
    kv_len_arr: Tensor = tensor_field(
        I32,
        ("reqs",),
        op="clamp",
        inputs=("seq_lens",),
        params={"lo": None, "hi": None},
        pad=PAD_DERIVED,
        doc="KV tokens per request (FlashInfer's kv_len_arr; its own buffer, refreshed by plan)",
    )
    plan_info: Tensor = tensor_field(
        torch.int64,
        (4,),
        op="flashinfer_plan",
        inputs=(*_PLAN_INPUTS, "kv_len_arr"),
        binds=_binds("kv_len_arr"),
        params={
            "kind": "mla",
            "page_size": Setting("page_size"),
            "next_n": Setting("next_n"),
            "heads": Setting("num_heads"),
            "head_dim": Setting("head_dim_ckv"),
            "rope_dim": Setting("head_dim_kpe"),
            "q_dtype": Setting("q_dtype"),
            "kv_dtype": Setting("kv_dtype"),
            "sm_scale": Setting("mla_sm_scale"),
            "workspace_mb": Setting("workspace_mb"),
            "backend": Setting("mla_backend"),
        },
        pad=PAD_DERIVED,
        doc="what FlashInfer was planned with: [requests, pages, tokens, longest] (host op)",
    )
    wrapper: Handle = handle_field("plan_info", doc="the FlashInfer wrapper planned for this plan")
    max_seq_len: int = scalar_field("max_len", doc="longest KV length the kernels must handle")
    next_n: int = scalar_field("next_n", doc="query tokens per request; > 1 plans causal verify")
    page_size: int = scalar_field("page_size", doc="tokens per KV page (1 or 64)")
    sm_scale: float = scalar_field("mla_sm_scale", doc="softmax scale of the absorbed MLA logits")

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """What FlashInfer's MLA kernels accept; refused when the planner is built."""
        b = "flashinfer_mla"
        check_positive_int(settings, "num_heads", b)
        if (settings["head_dim_ckv"], settings["head_dim_kpe"]) != (512, 64):
            raise SchemaError(
                "FlashInfer's MLA kernels are built for DeepSeek's 512 latent + 64 rope dims",
                field=f"{b}.head_dim_ckv",
                expected=(512, 64),
                actual=(settings["head_dim_ckv"], settings["head_dim_kpe"]),
            )
        if settings["page_size"] not in (1, 64):
            raise SchemaError(
                "MLA pages hold 1 or 64 tokens",
                field="page_size",
                expected=(1, 64),
                actual=settings["page_size"],
            )
        dtype_named(settings["q_dtype"], field=f"{b}.q_dtype")
        dtype_named(settings["kv_dtype"], field=f"{b}.kv_dtype")
        check_scale(settings["mla_sm_scale"], f"{b}.mla_sm_scale", optional=False)
        check_positive_int(settings, "workspace_mb", b)
        if settings["mla_backend"] not in ("auto", "fa2", "fa3"):
            raise SchemaError(
                "unknown MLA backend",
                field=f"{b}.mla_backend",
                expected=("auto", "fa2", "fa3"),
                actual=settings["mla_backend"],
            )
