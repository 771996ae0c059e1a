"""deep_gemm's paged MQA logits API with exact PyTorch references.

Mirrors the signatures of sgl-deep-gemm 0.1.0 (``get_paged_mqa_logits_metadata``,
``fp8_paged_mqa_logits``, ``fp8_mqa_logits``, ``fp8_fp4_paged_mqa_logits``,
``fp8_fp4_mqa_logits``: same arguments, order and defaults, our extras keyword-only; what
the references cannot do is refused naming the argument, see docs/verification.md) so
engine code can import from here instead of ``deep_gemm``: on CUDA tensors with a working ``deep_gemm`` the real kernels run, on
anything else the references (bit-exact for the integer schedule, exact fp32 math for the
logits). The references are exported too, so tests and planners can use them on purpose.
"""

from __future__ import annotations

from ._native import available as deep_gemm_available
from ._native import native_schedule_layout
from .fp8 import (
    FP8_MAX,
    PAGE,
    QUANT_BLOCK,
    dequantize_fp8_per_vector,
    gather_index_cache,
    index_cache_views,
    new_index_cache,
    pack_index_kv_cache,
    quantize_fp8_e4m3_per_vector,
    quantize_query,
    unpack_index_kv_cache,
    write_index_cache,
)
from .logits import (
    fp8_fp4_paged_mqa_logits,
    fp8_paged_mqa_logits,
    reference_fp8_paged_mqa_logits,
    validate_paged_logits_inputs,
)
from .mqa_logits import (
    fp8_fp4_mqa_logits,
    fp8_mqa_logits,
    mqa_logits_row_stride,
    reference_fp8_mqa_logits,
    validate_mqa_logits_inputs,
)
from .schedule import (
    BLOCK_KV,
    LAYOUTS,
    SPLIT_KV,
    get_paged_mqa_logits_metadata,
    paged_mqa_schedule_into,
    reference_paged_mqa_schedule,
    schedule_units,
    validate_context_lens,
    validate_indices,
)

__all__ = [
    "BLOCK_KV",
    "FP8_MAX",
    "LAYOUTS",
    "PAGE",
    "QUANT_BLOCK",
    "SPLIT_KV",
    "deep_gemm_available",
    "dequantize_fp8_per_vector",
    "gather_index_cache",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "index_cache_views",
    "mqa_logits_row_stride",
    "native_schedule_layout",
    "new_index_cache",
    "pack_index_kv_cache",
    "paged_mqa_schedule_into",
    "quantize_fp8_e4m3_per_vector",
    "quantize_query",
    "reference_fp8_mqa_logits",
    "reference_fp8_paged_mqa_logits",
    "reference_paged_mqa_schedule",
    "schedule_units",
    "unpack_index_kv_cache",
    "validate_context_lens",
    "validate_indices",
    "validate_mqa_logits_inputs",
    "validate_paged_logits_inputs",
    "write_index_cache",
]
