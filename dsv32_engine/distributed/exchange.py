"""The FFN's row exchange under data-parallel attention: the per-forward collective.

Under data-parallel attention each rank attends over its own requests, and the MoE
then runs over the tokens of every rank (expert parallelism spreads the experts over
ranks; here weights are replicated, so each rank runs every row and keeps its own:
its rows' outputs are the same bits as without the exchange, which the greedy-token
test relies on). What matters for the planner is the lockstep it forces: every rank
must enter this all-gather in every layer of every forward, with the same number of
rows. A rank that skipped a step, or replayed another graph size, stalls its peers,
and the group's timeout turns that into an error instead of a hang.

The model takes it as a callable (``DSV32Model.set_ffn_exchange``): ``dsv32_engine/models/`` does
not import this package. It runs inside captured graphs too (NCCL collectives
capture; the CPU emulation re-runs it at every replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dsv32_engine.distributed.group import DistContext, all_gather_flat


class RowExchange:
    """``exchange(x, ffn)``: all-gather ``x``'s rows from every rank, run ``ffn``, keep own rows.

    ``rows`` (set per eager step) pads every rank's rows to the largest rank's count;
    ``None`` (graph steps, capture) requires equal counts, which equal graph sizes give.
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.rows: int | None = None
        self.calls = 0
        """All-gathers entered (one per layer per forward): equal on every rank."""

    def __call__(
        self, x: torch.Tensor, ffn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        own = x.shape[0]
        target = own if self.rows is None else self.rows
        if own > target:
            raise ValueError(f"{own} rows exceed the agreed {target} of this step")
        if own < target:
            x = torch.cat([x, x.new_zeros(target - own, *x.shape[1:])])
        gathered = x.new_empty(self.ctx.world * target, *x.shape[1:])
        all_gather_flat(gathered, x.contiguous(), group=self.ctx.device_group)
        self.calls += 1
        start = self.ctx.rank * target
        return ffn(gathered)[start : start + own]


class HeadReduce:
    """``reduce(partial)``: the tensor-parallel all-reduce (sum) of ``wo``'s partial outputs,
    in place, over the device group; one per layer per forward, inside graphs too."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.calls = 0

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.ctx.device_group)
        self.calls += 1
        return partial
