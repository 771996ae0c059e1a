"""The lanes' door: a uniform host batch's checks and the compiled screen's reads in one pass.

Why: the replay lane (``planner.replay_lane``) and the eager lane (``planner.eager_lane``)
take the same batches, decode and verify ones whose inputs are all on the host, and both
must read each tensor once: its type, dtype, rank, device, contiguity and length (the
door's checks, ``planner.door``) and, in the same reads, the kind and address the
compiled screen takes. Anything not exactly right gives None ("not mine"); the general
path then runs, and its door names what is wrong.

So a lane never accepts what the door refuses: each check here is the door's comparison
or a stricter one (an exact ``torch.Tensor``, where the door takes subclasses; host index
inputs only, where the door also takes device ones).
"""

from __future__ import annotations

import torch

from planner.batch import ForwardBatch
from planner.staging_screen import K_DERIVED, K_I32, K_I64

_TENSOR, _INT32, _INT64 = torch.Tensor, torch.int32, torch.int64

HostSources = tuple[torch.Tensor, int, int, int, int, int, int, int]
"""``(seq_lens_cpu, requests, pool kind, pool address, slot kind, slot address, positions'
kind, positions' address)``: what the screen is called with (kinds of
``planner.staging_screen``)."""


def host_sources(batch: object, next_n: int) -> HostSources | None:
    """A uniform host batch's lengths, request count and index sources; None where a lane
    cannot take it (not a plain ``ForwardBatch``, another ``next_n``, given extend lengths,
    device copies of the lengths, an empty batch, any input not a 1-D contiguous host tensor
    of its length and dtype)."""
    if (
        batch.__class__ is not ForwardBatch
        or batch.next_n != next_n
        or batch.extend_lens_cpu is not None
        or batch.seq_lens is not None
        or batch.extend_lens is not None
    ):
        return None
    seq = batch.seq_lens_cpu
    if not (
        seq.__class__ is _TENSOR
        and seq.dtype is _INT32
        and seq.ndim == 1
        and seq.is_cpu
        and seq.is_contiguous()
    ):
        return None
    real = seq.numel()
    if not real:  # empty or idle: the door's messages
        return None
    tokens = real * next_n
    pool_kind, pool = host_index(batch.req_pool_indices, real)
    slot_kind, slot = host_index(batch.out_cache_loc, tokens)
    positions = batch.positions
    if positions is None:
        pos_kind, pos = K_DERIVED, 0
    else:
        pos_kind, pos = host_index(positions, tokens)
    if not (pool_kind and slot_kind and pos_kind):
        return None
    return seq, real, pool_kind, pool, slot_kind, slot, pos_kind, pos


def table_on(table: object, device: torch.device, on_host: bool) -> bool:
    """Whether the token table passes the door's checks: a 2-D contiguous int32 tensor on the
    planner's ``device`` (``on_host``: any host device, as the door reads it)."""
    return (
        table.__class__ is _TENSOR
        and table.dtype is _INT32
        and table.ndim == 2
        and table.is_contiguous()
        and (table.is_cpu if on_host else table.device == device)
    )


def host_index(tensor: object, length: int) -> tuple[int, int]:
    """A host index input's screen kind and address; kind 0 where a lane cannot take it
    (the door's checks for it: a 1-D contiguous int32 / int64 tensor of ``length``)."""
    if (
        tensor.__class__ is _TENSOR
        and tensor.ndim == 1
        and tensor.is_cpu
        and tensor.is_contiguous()
        and tensor.numel() == length
    ):
        dtype = tensor.dtype
        if dtype is _INT64:
            return K_I64, tensor.data_ptr()
        if dtype is _INT32:
            return K_I32, tensor.data_ptr()
    return 0, 0
