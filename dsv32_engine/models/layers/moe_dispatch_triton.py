"""The routed MoE's dispatch bookkeeping (``moe_routing.sort_by_expert``) as one launch.

In torch it is about ten kernels (a stable sort, an arange, searchsorted, casts, the
``order // top_k`` division, the weights' cast and gather), each a launch and an idle gap
in a CUDA graph, in every MoE layer. Here one program holds all ``P = rows * top_k``
pairs: it sorts them by a key that is unique and orders as the stable sort does (expert
id in the high bits, pair id in the low ones), then writes the pair order, each pair's
token row and weight in that order, and the groups' ends from a histogram of the experts
and its running sum. The outputs are ``sort_by_expert``'s torch path's, bit for bit:
nothing is computed but integer keys and copies.

One program sorting ``P`` keys (``tl.sort``, a bitonic network) is a decode-sized tool:
``MAX_PAIRS`` bounds it, and the caller keeps the torch path above that, decided from the
shapes. Every size comes from the inputs' shapes and nothing is read back, so the launch
can be captured in a CUDA graph. Expert ids must be in ``[0, E)`` (as ``Gate`` makes
them); others give an unspecified order, never an access out of bounds.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["MAX_EXPERTS", "MAX_PAIRS", "sort_by_expert_triton"]

MAX_PAIRS = 8192
"""Most pairs one launch sorts: a prefill chunk of 1024 tokens at top-8."""

MAX_EXPERTS = 1024
"""Most experts: the histogram is one register vector of them. With ``MAX_PAIRS`` the keys
need 23 bits, well inside an int32."""

PAIR_BLOCKS = (16, 128, 1024, MAX_PAIRS)
"""The sort widths the launcher picks from (``_pairs_block``); results do not depend on it."""
# Warps by padded pair count: about the fewest that keep the sort's keys in registers, as
# every cross-warp stage of the network is a barrier (sm_90 builds with the bundled ptxas:
# no spill up to 4096 pairs; 8192 spills ~100 bytes a thread at 16 warps or 32). A tuning
# knob only: results do not depend on it.
_WARPS = {256: 2, 512: 2, 1024: 4, 2048: 8, 4096: 16, 8192: 16}


def _dispatch_kernel(
    order_ptr,
    rows_ptr,
    sorted_weights_ptr,
    ends_ptr,
    indices_ptr,
    weights_ptr,
    n_pairs,
    top_k,
    N_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    PAIRS_P2: tl.constexpr,
    PAIR_BITS: tl.constexpr,
):
    p = tl.arange(0, PAIRS_P2)
    live = p < n_pairs
    expert = tl.load(indices_ptr + p, mask=live, other=0)
    # Clamped so a bad id can neither overflow the key nor leave the histogram's range.
    expert = tl.minimum(tl.maximum(expert, 0), N_EXPERTS).to(tl.int32)
    # Unique keys, so the sort needs no stability of its own; padding sorts last.
    key = tl.where(live, (expert << PAIR_BITS) | p, 2147483647)
    pair = tl.sort(key) & (PAIRS_P2 - 1)
    tl.store(order_ptr + p, pair.to(tl.int64), mask=live)
    tl.store(rows_ptr + p, (pair // top_k).to(tl.int64), mask=live)
    w = tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)
    tl.store(sorted_weights_ptr + p, w, mask=live)
    # ends[e] = pairs with expert <= e, which is what searchsorted(right=True) counts.
    counted = live & (expert < N_EXPERTS)
    hist = tl.histogram(tl.where(counted, expert, 0), EXPERTS_P2, mask=counted)
    bins = tl.arange(0, EXPERTS_P2)
    tl.store(ends_ptr + bins, tl.cumsum(hist, axis=0), mask=bins < N_EXPERTS)


_dispatch = LazyKernel(_dispatch_kernel)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pairs_block(n_pairs: int) -> int:
    """The sort's width: the smallest of ``PAIR_BLOCKS`` that holds the pairs.

    Each width is a compiled variant, and one first met mid-serving compiles there
    (seconds on the H200). A few fixed widths are few enough for graph capture and the
    engine's extend warm-up (``Scheduler.warm_up_batches``) to compile those the model
    uses; sorting up to 8x more keys than a batch has costs a few microseconds."""
    for block in PAIR_BLOCKS:
        if n_pairs <= block:
            return block
    raise ValueError(f"1 to {MAX_PAIRS} pairs in one launch, got {n_pairs}")


def sort_by_expert_triton(
    weights: torch.Tensor, indices: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order int64 [P], rows int64 [P], weights fp32 [P], ends int32 [E])`` for the
    ``[rows, top_k]`` choices, as ``sort_by_expert``'s torch path gives them. ``P`` from
    1 to ``MAX_PAIRS``; ``indices`` int32 or int64. Needs CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``."""
    require_launchable(indices.device, "sort")
    if indices.dim() != 2 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be an integer [rows, top_k], got {indices.dtype}")
    if weights.shape != indices.shape or not weights.is_floating_point():
        raise ValueError(f"weights must be a float {tuple(indices.shape)}, got {weights.shape}")
    if weights.device != indices.device:
        raise ValueError(f"weights are on {weights.device}, indices on {indices.device}")
    n_pairs = indices.numel()
    if not 0 < n_pairs <= MAX_PAIRS:
        raise ValueError(f"1 to {MAX_PAIRS} pairs in one launch, got {n_pairs}")
    if not 0 < n_experts <= MAX_EXPERTS:
        raise ValueError(f"1 to {MAX_EXPERTS} experts, got {n_experts}")
    dev = indices.device
    order = torch.empty(n_pairs, dtype=torch.int64, device=dev)
    rows = torch.empty(n_pairs, dtype=torch.int64, device=dev)
    sorted_weights = torch.empty(n_pairs, dtype=torch.float32, device=dev)
    ends = torch.empty(n_experts, dtype=torch.int32, device=dev)
    pairs_p2 = _pairs_block(n_pairs)
    _dispatch[(1,)](
        order,
        rows,
        sorted_weights,
        ends,
        indices.contiguous().view(-1),  # no copy for the router's outputs
        weights.contiguous().view(-1),
        n_pairs,
        indices.shape[1],
        N_EXPERTS=n_experts,
        EXPERTS_P2=_pow2(n_experts),
        PAIRS_P2=pairs_p2,
        PAIR_BITS=pairs_p2.bit_length() - 1,
        num_warps=_WARPS.get(pairs_p2, 1),
    )
    return order, rows, sorted_weights, ends
