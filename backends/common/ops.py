"""The generic metadata ops every paged backend needs, with their providers.

Each op's ``torch`` provider is the exact reference (graph-safe: no host
syncs, no data-dependent shapes); ``triton`` is our kernel, chosen on CUDA
and tested bit-equal against the reference under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from backends.common import torch_ref as ref
from backends.common import triton_kernels as tri
from planner.ops import metadata_op

triton_usable = tri.triton_available

cumsum_with_zero = metadata_op(
    "cumsum_with_zero", "out[0] = 0, out[i+1] = x[0] + ... + x[i]: cumulative lengths (cu_seqlens)."
)
clamp = metadata_op(
    "clamp", "out = clamp(x, lo, hi) elementwise: e.g. sparse lengths min(len, topk)."
)
uniform_offsets = metadata_op(
    "uniform_offsets",
    "out[i] = i * step: cumulative query lengths when every request has step tokens.",
)
gather_token_slots = metadata_op(
    "gather_token_slots",
    "out[r, j] = req_to_token[req_pool_indices[r], j] for j < seq_lens[r], else the null slot 0.",
)
page_table = metadata_op(
    "page_table",
    "out[r, p] = token_slots[r, p * page_size] // page_size: page ids, 0 (the null page) past the end.",
)
causal_lengths = metadata_op(
    "causal_lengths",
    "out[r*n + i] = seq_lens[r] - (n - 1 - i): per-token KV lengths of n verify tokens per "
    "request; the lengths themselves when n is 1 (decode).",
    identity=lambda params: params.get("next_n") == 1,
)


def with_providers(pairs) -> None:
    """Each op gets its exact torch reference and its Triton kernel (where Triton runs)."""
    for op, reference, kernel in pairs:
        op.provider("torch")(reference)
        op.provider("triton", available=triton_usable)(kernel)


with_providers(
    [
        (cumsum_with_zero, ref.cumsum_with_zero, tri.cumsum_with_zero),
        (clamp, ref.clamp_into, tri.clamp_into),
        (uniform_offsets, ref.uniform_offsets, tri.uniform_offsets),
        (gather_token_slots, ref.gather_token_slots, tri.gather_token_slots),
        (page_table, ref.page_table_from_slots, tri.page_table_from_slots),
        (causal_lengths, ref.causal_lengths, tri.causal_lengths),
    ]
)
