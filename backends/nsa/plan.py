"""The NSA (DeepSeek-V3.2 sparse attention) plan: what the indexer and sparse MLA read.

Extends the paged plan with the query offsets, the sparse lengths and the
deep_gemm schedule, over a 64-token page table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from backends.deepgemm import BLOCK_KV, LAYOUTS
from backends.nsa import mla_split
from backends.nsa import ops as _ops  # noqa: F401  (registers paged_mqa_schedule)
from backends.paged.plan import PagedPlan
from planner.errors import SchemaError
from planner.schema import PAD_DERIVED, Setting, Tensor, scalar_field, tensor_field

I32 = torch.int32

NATIVE_NEXT_N = (1, 2)
"""The ``next_n`` deep_gemm's paged MQA logits take on Hopper: the one declaration the planner
lays verify rows out from (natively for these, expanded to one row per token otherwise)."""


def topk_lens_field(topk: str, doc: str) -> Any:
    """``min(kv_len, topk)`` per query row, ``topk`` the setting that names it; declared by
    each schema that reads it (the planner computes it once for all of them)."""
    return tensor_field(
        I32,
        ("rows",),
        op="clamp",
        inputs=("kv_lens",),
        params={"lo": None, "hi": Setting(topk)},
        pad=PAD_DERIVED,
        doc=doc,
    )


class NSAPlan(PagedPlan, backend="nsa"):
    """What DeepSeek-V3.2's indexer and sparse MLA read in every layer (decode and target-verify).

    Everything a paged kernel reads (lengths, causal ``kv_lens`` = deep_gemm's
    ``context_lens`` viewed ``[kernel_reqs, kernel_next_n]``, token slots, the
    64-token page table) comes from :class:`PagedPlan`; this adds the query
    offsets, the sparse lengths, deep_gemm's block table and the schedule.
    Verify with ``next_n`` deep_gemm takes (1, 2) is laid out natively; any
    other ``next_n`` is expanded (one kernel request per row: the staircase
    lengths, the page table repeated per token, the schedule with next_n 1).
    """

    defaults: ClassVar[dict[str, Any]] = {
        "topk": 2048,
        "block_kv": BLOCK_KV,
        "schedule_layout": "0.1.0",
        "native_next_n": NATIVE_NEXT_N,
        **mla_split.DEFAULTS,
    }

    cu_seqlens_q: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="uniform_offsets",
        params={"step": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="query offsets per request",
    )
    topk_lens: Tensor = topk_lens_field(
        "topk", "tokens sparse attention reads per row: min(kv_len, topk)"
    )
    kernel_page_table: Tensor = tensor_field(
        I32,
        ("kernel_reqs", "pages"),
        op="repeat_rows",
        inputs=("page_table",),
        params={"times": Setting("row_repeat")},
        pad=0,
        doc="deep_gemm's block_table: the page table, its rows repeated per token when expanded "
        "(the page table itself when native)",
    )
    schedule: Tensor = tensor_field(
        I32,
        ("sms+1", 2),
        op="paged_mqa_schedule",
        inputs=("kv_lens",),
        params={
            "next_n": Setting("kernel_next_n"),
            "block_kv": Setting("block_kv"),
            "num_sms": Setting("num_sms"),
            "layout": Setting("schedule_layout"),
        },
        pad=PAD_DERIVED,
        doc="deep_gemm paged MQA schedule: (request, split) each SM starts at; last row the end",
    )
    mla_split_plan: Tensor = mla_split.split_table_field("rows")
    topk: int = scalar_field("topk", doc="tokens each query row attends to, at most")
    kernel_next_n: int = scalar_field(
        "kernel_next_n", doc="query rows per kernel request: next_n natively, 1 when expanded"
    )
    mla_splits: int = mla_split.splits_field()
    mla_kernel: str = mla_split.kernel_field()

    @classmethod
    def derived_dims(cls, dims: Mapping[str, int], settings: Mapping[str, Any]) -> dict[str, int]:
        """The sparse MLA kernel's split count for this batch size (see ``mla_split``):
        ``mla_fixed_splits`` whatever the rows when set, else the wave model's."""
        return mla_split.split_dims(dims["rows"], dims, settings)

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """What deep_gemm's kernels accept; refused at planner build, not at the first batch."""
        mla_split.check_settings(settings)
        if settings["block_kv"] != BLOCK_KV:
            raise SchemaError(
                "deep_gemm on Hopper needs 64-token blocks",
                field="nsa.block_kv",
                expected=BLOCK_KV,
                actual=settings["block_kv"],
            )
        if settings["page_size"] != BLOCK_KV:
            raise SchemaError(
                "the NSA page table is built from 64-token KV pages",
                field="page_size",
                expected=BLOCK_KV,
                actual=settings["page_size"],
            )
        native = settings["native_next_n"]
        if not isinstance(native, (tuple, list)) or not set(native) <= set(NATIVE_NEXT_N):
            raise SchemaError(
                "deep_gemm's paged MQA logits take next_n 1 or 2 natively (others are expanded)",
                field="nsa.native_next_n",
                expected=f"a subset of {NATIVE_NEXT_N}",
                actual=native,
            )
        topk = settings["topk"]
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise SchemaError(
                "top-k must be a positive int", field="nsa.topk", expected=">= 1", actual=topk
            )
        if settings["schedule_layout"] not in LAYOUTS:
            raise SchemaError(
                "unknown schedule layout",
                field="nsa.schedule_layout",
                expected=LAYOUTS,
                actual=settings["schedule_layout"],
            )
