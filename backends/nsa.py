"""DeepSeek-V3.2 NSA backend: what the lightning indexer and sparse MLA read, planned once.

The seed of the product. Upstream engines called
``deep_gemm.get_paged_mqa_logits_metadata`` in every one of the 61 indexer
layers although it depends only on the batch; here the schedule is a plan
field, computed once per batch in every phase (inside the CUDA graph when
captured), from lengths that are never zero, over a 64-token page table.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from backends.deepgemm import BLOCK_KV, LAYOUTS, paged_mqa_schedule_into
from backends.deepgemm import _native as native
from backends.paged import PagedPlan
from planner.errors import SchemaError
from planner.ops import metadata_op
from planner.schema import PAD_DERIVED, Setting, Tensor, scalar_field, tensor_field

I32 = torch.int32

paged_mqa_schedule = metadata_op(
    "paged_mqa_schedule",
    "deep_gemm's paged MQA logits SM schedule [num_sms+1, 2] from per-row KV lengths [reqs*next_n].",
)


@paged_mqa_schedule.provider("torch")
def _schedule_torch(
    out: torch.Tensor, kv_lens: torch.Tensor, next_n: int, block_kv: int, num_sms: int, layout: str
) -> None:
    # Lengths were validated at the planner's door (>= next_n), so no device read is needed here.
    paged_mqa_schedule_into(
        out, kv_lens.view(-1, next_n), block_kv, num_sms, layout, check_values=False
    )


def _deep_gemm_usable(device: torch.device) -> bool:
    return device.type == "cuda" and native.available()


@paged_mqa_schedule.provider("deep_gemm", available=_deep_gemm_usable)
def _schedule_deep_gemm(
    out: torch.Tensor, kv_lens: torch.Tensor, next_n: int, block_kv: int, num_sms: int, layout: str
) -> None:
    built = native.native_schedule_layout()
    if built is not None and built != layout:
        raise SchemaError(
            "installed deep_gemm places the schedule remainder differently from the configured layout",
            field="nsa.schedule",
            expected=layout,
            actual=built,
        )
    out.copy_(
        native.load().get_paged_mqa_logits_metadata(kv_lens.view(-1, next_n), block_kv, num_sms)
    )


class NSAPlan(PagedPlan, backend="nsa"):
    """What DeepSeek-V3.2's indexer and sparse MLA read in every layer (decode and target-verify).

    Everything a paged kernel reads (lengths, causal ``kv_lens`` = deep_gemm's
    ``context_lens`` viewed ``[reqs, next_n]``, token slots, the 64-token page
    table = deep_gemm's ``block_table``) comes from :class:`PagedPlan`; this adds
    the query offsets, the sparse lengths and the schedule.
    """

    defaults: ClassVar[dict[str, Any]] = {
        "topk": 2048,
        "block_kv": BLOCK_KV,
        "schedule_layout": "0.1.0",
    }

    cu_seqlens_q: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="uniform_offsets",
        params={"step": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="query offsets per request",
    )
    topk_lens: Tensor = tensor_field(
        I32,
        ("rows",),
        op="clamp",
        inputs=("kv_lens",),
        params={"lo": None, "hi": Setting("topk")},
        pad=PAD_DERIVED,
        doc="tokens sparse attention reads per row: min(kv_len, topk)",
    )
    schedule: Tensor = tensor_field(
        I32,
        ("sms+1", 2),
        op="paged_mqa_schedule",
        inputs=("kv_lens",),
        params={
            "next_n": Setting("next_n"),
            "block_kv": Setting("block_kv"),
            "num_sms": Setting("num_sms"),
            "layout": Setting("schedule_layout"),
        },
        pad=PAD_DERIVED,
        doc="deep_gemm paged MQA schedule: (request, split) each SM starts at; last row the end",
    )
    topk: int = scalar_field("topk", doc="tokens each query row attends to, at most")

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """What deep_gemm's kernels accept; refused at planner build, not at the first batch."""
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
        if settings["next_n"] not in (1, 2):
            raise SchemaError(
                "deep_gemm's paged MQA logits take next_n 1 or 2",
                field="next_n",
                expected=(1, 2),
                actual=settings["next_n"],
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


def warmup_schedule_buckets(max_batch: int, next_n: int, num_sms: int, device: torch.device) -> int:
    """Compile deep_gemm's schedule kernel for every batch bucket (32 rows each) up to ``max_batch``.

    The kernel is JIT-compiled per bucket (1.3-2 s the first time): doing it
    before capture keeps compilation out of graph capture and out of serving.
    Returns the number of buckets warmed (0 when deep_gemm is not in use).
    """
    if not _deep_gemm_usable(device):
        return 0
    dg = native.load()
    buckets = 0
    for bs in range(32, max_batch + 32, 32):
        lens = torch.full((min(bs, max_batch), next_n), next_n, dtype=I32, device=device)
        lens[:, :] = torch.arange(1, next_n + 1, dtype=I32, device=device)
        dg.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
        buckets += 1
    torch.cuda.synchronize(device)
    return buckets
