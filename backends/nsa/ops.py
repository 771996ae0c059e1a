"""The NSA backend's own metadata op: deep_gemm's paged MQA schedule, and its warm-up.

Upstream engines called ``deep_gemm.get_paged_mqa_logits_metadata`` in every
one of the 61 indexer layers although it depends only on the batch; here it
is an op the planner runs once per batch (inside the CUDA graph when
captured), from lengths that are never zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.deepgemm import BLOCK_KV, paged_mqa_schedule_into
from backends.deepgemm import _native as native
from planner.errors import SchemaError
from planner.limits import Limits
from planner.ops import metadata_op

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


def _warm_buckets(limits: Limits, params: Mapping[str, Any], device: torch.device) -> None:
    # expanded verify rows are kernel requests of their own: up to max_batch * next_n of them
    kernel_reqs = limits.max_batch * max(limits.next_n // params["next_n"], 1)
    warmup_schedule_buckets(kernel_reqs, params["next_n"], params["num_sms"], device)


@paged_mqa_schedule.provider("deep_gemm", available=_deep_gemm_usable, warmup=_warm_buckets)
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
