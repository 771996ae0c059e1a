"""DeepSeek-V3.2 NSA: plan schemas (decode/verify, extend, draft extend), their ops, and the
attention that reads them."""

from backends.nsa.attention import dense_mla_decode, indexer_topk, sparse_mla_decode
from backends.nsa.draft_plan import NSADraftExtendPlan
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.ops import paged_mqa_schedule, warmup_schedule_buckets
from backends.nsa.plan import NSAPlan

__all__ = [
    "NSADraftExtendPlan",
    "NSAExtendPlan",
    "NSAPlan",
    "dense_mla_decode",
    "indexer_topk",
    "paged_mqa_schedule",
    "sparse_mla_decode",
    "warmup_schedule_buckets",
]
