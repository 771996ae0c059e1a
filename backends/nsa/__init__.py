"""DeepSeek-V3.2 NSA: plan schema, the schedule op, and the attention that reads the plan."""

from backends.nsa.attention import dense_mla_decode, indexer_topk, sparse_mla_decode
from backends.nsa.ops import paged_mqa_schedule, warmup_schedule_buckets
from backends.nsa.plan import NSAPlan

__all__ = [
    "NSAPlan",
    "dense_mla_decode",
    "indexer_topk",
    "paged_mqa_schedule",
    "sparse_mla_decode",
    "warmup_schedule_buckets",
]
