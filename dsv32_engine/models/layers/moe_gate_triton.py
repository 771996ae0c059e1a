"""The MoE router after its GEMM as one Triton launch, for the CUDA forward.

In torch, ``Gate.forward`` runs about fifteen kernels after the gate GEMM (cast, sigmoid,
bias add, the group top-2 and its sum, the group top-k, a scattered mask, masked_fill, the
expert top-k, gather, sum, divide, scale), each a launch and an idle gap in a CUDA graph:
58 MoE layers a decode step. Here a program owns one token row: it reads the ``[E]`` logits
once (the GEMM's own dtype, widened in registers, which also saves the cast's launch) and
writes the ``top_k`` indices and weights.

Semantics are ``route_reference``'s (the torch path, unchanged): sigmoid scores; the bias
steers the choice only; with groups, a group's score is the sum of its two best biased
scores and only the ``topk_group`` best groups stay eligible; the ``top_k`` best eligible
experts by biased score, in descending order (the combine sums slots in this order);
weights are their unbiased scores normalised over the chosen ones, times ``route_scale``.

Ties (equal biased scores, or equal group scores): the lower expert (group) id ranks first.
``torch.topk`` leaves that order unspecified, so ``route_reference`` selects by stable
descending sorts instead: the kernel and the reference agree on ties too.

Numerics follow torch's CUDA kernels so that the choices are torch's: the sigmoid is
``1 / (1 + expf(-x))`` in fp32 with libdevice's ``expf`` (CUDA's own) and an IEEE
division, as ``swiglu_triton`` does (``tl.exp`` where libdevice is missing or under the
interpreter). The normalising sum takes the reduction tree torch uses for one row of a
``[rows, k]`` sum over ``k <= 32`` (lane ``i`` adds elements ``i`` and ``i + L``, ``L``
the largest power of two ``<= k``, then lanes combine by halving strides). On the H200
(r6-3) the experts were torch's, and the weights torch's bits at 1 row (8 weights) but
not from 16 rows on, in the last bits: torch's reduction may take another order for a
larger batch, or the compiler may contract the sigmoid's arithmetic; which one is not
established. The GPU tests hold the weights to 1e-6 relative.

Selection packs each biased score into an order-preserving int64 key with its lane in the
low bits, so one integer max per choice yields both the best value and the lowest id among
equals. The grid is the row count; nothing is read back and shapes come from the inputs:
capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable
from backends.common.triton_launch import next_power_of_2
from dsv32_engine.models.layers.exact import sigmoid
from dsv32_engine.models.layers.swiglu_triton import exp_is_libdevice, libdevice  # the kernel's exp

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["MAX_EXPERTS", "route_reference", "route_triton", "select_experts"]

MAX_EXPERTS = 256
"""Widest router the kernel takes: a row's keys live in one warp's registers."""

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def select_experts(
    scores: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch routing from sigmoid ``scores [rows, E]``: ``(weights, indices)``. Kept apart
    from the sigmoid so the interpreter tests can feed the scores of its own exp.

    Ties (equal biased scores, equal group scores) rank the lower expert (group) id first,
    the kernel's rule: the choices are stable descending sorts, not ``torch.topk``, whose
    order among equal values is unspecified (and differs between devices and shapes, so a
    tie could route a row differently in another batch). Where values differ the two
    agree, choices and order: the CPU model's outputs are what they were with ``topk``."""
    biased = scores + bias
    if n_group > 1:
        grouped = biased.unflatten(-1, (n_group, -1))
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [rows, n_group]: values only
        kept = _top_ids(group_score, topk_group)
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        biased = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(-2)
    indices = _top_ids(biased, top_k)
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(-1, keepdim=True) * route_scale
    return weights, indices


def _top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest ``values`` along the last dim, largest first, lower id
    first among equals (a stable descending sort)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Gate``'s torch path from the GEMM's logits: the CPU model's (float64 sigmoid, see
    ``exact``) and what the kernel is held to on the GPU."""
    return select_experts(sigmoid(logits.float()), bias, top_k, n_group, topk_group, route_scale)


def _route_kernel(
    weights_ptr,
    indices_ptr,
    logits_ptr,
    bias_ptr,
    logits_stride,
    route_scale,
    TOP_K: tl.constexpr,
    TOPK_P2: tl.constexpr,
    LANES: tl.constexpr,
    LOG_LANES: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    PER_GROUP: tl.constexpr,
    PER_P2: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    # Experts as [groups, per group]: lane (g, j) is expert g * PER_GROUP + j, any E.
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_P2)[:, None]
    j = tl.arange(0, PER_P2)[None, :]
    valid = (g < N_GROUP) & (j < PER_GROUP)
    expert = g * PER_GROUP + j
    lane = g * PER_P2 + j  # unique, and in expert order on valid lanes
    x_row = logits_ptr + row * logits_stride
    x = tl.load(x_row + expert, mask=valid, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    one = tl.full([GROUPS_P2, PER_P2], 1.0, tl.float32)
    scores = tl.math.div_rn(one, one + e)  # torch's 1 / (1 + exp(-x)), IEEE division
    b = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    biased = tl.where(valid, scores + b, float("-inf"))

    # Order-preserving key: the float's bits, all but the sign flipped for negatives (no
    # -0.0 to fold: a sigmoid is never negative, so a sum with it is never -0.0); then the
    # lane, reversed, so a max prefers the lower id.
    v = biased.to(tl.int32, bitcast=True)
    ordered = v ^ ((v >> 31) & 0x7FFFFFFF)
    low = (GROUPS_P2 * PER_P2 - 1) - lane
    key = (ordered.to(tl.int64) << 32) | low.to(tl.int64)
    gone = tl.full([GROUPS_P2, PER_P2], -(2**63), tl.int64)  # below every real key
    key = tl.where(valid, key, gone)

    if TOPK_GROUP < N_GROUP:  # otherwise every group stays and the mask changes nothing
        # A group's two best: the max, then the max with that one lane (keys are unique)
        # removed, so an equal second value still counts twice, as torch's topk(2) does.
        k1 = tl.max(key, axis=1)
        top1 = tl.max(biased, axis=1)
        top2 = tl.max(tl.where(key == k1[:, None], float("-inf"), biased), axis=1)
        gscore = top1 + top2
        gid = tl.arange(0, GROUPS_P2)
        gv = gscore.to(tl.int32, bitcast=True)
        gkey = ((gv ^ ((gv >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (GROUPS_P2 - 1 - gid)
        gkey = tl.where(gid < N_GROUP, gkey, tl.full([GROUPS_P2], -(2**63), tl.int64))
        kept = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=0)
            kept = kept | (gkey == best)
            gkey = tl.where(gkey == best, -(2**63), gkey)
        key = tl.where(kept[:, None], key, gone)

    # The experts one at a time, best first: one int64 max each, its lane then retired
    # (the cast to int32 keeps the key's low half, the reversed lane).
    ks = tl.arange(0, TOPK_P2)
    picked = tl.zeros([TOPK_P2], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key)
        key = tl.where(key == best, gone, key)
        picked = tl.where(ks == k, (GROUPS_P2 * PER_P2 - 1) - best.to(tl.int32), picked)
    chosen = (picked // PER_P2) * PER_GROUP + (picked % PER_P2)
    taken = ks < TOP_K

    # The chosen scores, recomputed from their logits by the same formula (same bits):
    # cheaper than carrying a value out of every selection step.
    xs = tl.load(x_row + chosen, mask=taken, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        es = libdevice.exp(-xs)
    else:
        es = tl.exp(-xs)
    ones = tl.full([TOPK_P2], 1.0, tl.float32)
    s = tl.where(taken, tl.math.div_rn(ones, ones + es), 0.0)

    # torch's reduction tree (see the module docstring); padding adds exact zeros.
    if TOPK_P2 > LANES:
        t = tl.sum(tl.reshape(s, [2, LANES]), axis=0)
    else:
        t = s
    for level in tl.static_range(LOG_LANES):
        t = tl.sum(tl.reshape(t, [LANES >> (level + 1), 2]), axis=1)
    total = tl.sum(t, axis=0)
    w = tl.math.div_rn(s, tl.full([TOPK_P2], 1.0, tl.float32) * total) * route_scale
    out = row * TOP_K + ks
    tl.store(weights_ptr + out, w, mask=taken)
    tl.store(indices_ptr + out, chosen.to(tl.int64), mask=taken)


_route = LazyKernel(_route_kernel)


def _check(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> None:
    if logits.dim() != 2 or logits.dtype not in _FLOATS:
        raise ValueError(f"logits must be a float [rows, E], got {logits.dtype} {logits.shape}")
    n_experts = logits.shape[1]
    if not 0 < n_experts <= MAX_EXPERTS:
        raise ValueError(f"1 to {MAX_EXPERTS} experts, got {n_experts}")
    if tuple(bias.shape) != (n_experts,) or bias.dtype not in _FLOATS:
        raise ValueError(f"bias must be a float [{n_experts}], got {bias.dtype} {bias.shape}")
    if bias.device != logits.device:
        raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{n_experts} experts in {n_group} groups, top {topk_group}")
    per_group = n_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError("groups are ranked by their two best experts: need >= 2 a group")
    eligible = n_experts if topk_group >= n_group else topk_group * per_group
    if not 1 <= top_k <= eligible:
        raise ValueError(f"top_k {top_k} out of 1..{eligible} (experts in the kept groups)")


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_reference`` in one launch: ``(weights [rows, top_k] fp32, indices int64)``.
    ``logits [rows, E]`` in fp32, fp16 or bf16 (unit column stride, any row stride), read
    as fp32; ``bias [E]``. Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    require_launchable(logits.device, "max")
    _check(logits, bias, top_k, n_group, topk_group)
    rows, n_experts = logits.shape
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return weights, indices
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    per_group = n_experts // n_group
    groups = n_group if n_group > 1 and topk_group < n_group else 1
    per = n_experts // groups
    lanes = 1 << (top_k.bit_length() - 1)  # the largest power of two <= top_k
    _route[(rows,)](
        weights,
        indices,
        logits,
        bias,
        logits.stride(0) if rows > 1 else n_experts,
        float(route_scale),
        TOP_K=top_k,
        TOPK_P2=next_power_of_2(top_k),
        LANES=lanes,
        LOG_LANES=lanes.bit_length() - 1,
        N_GROUP=groups,
        GROUPS_P2=next_power_of_2(groups),
        PER_GROUP=per if groups == 1 else per_group,
        PER_P2=next_power_of_2(per),
        TOPK_GROUP=topk_group if groups > 1 else 1,
        # The interpreter cannot call libdevice; it evaluates tl.exp with numpy instead.
        LIBDEVICE_EXP=exp_is_libdevice(),
        # A row is at most 256 keys: one warp holds them, and no reduction crosses warps.
        num_warps=1,
    )
    return weights, indices
