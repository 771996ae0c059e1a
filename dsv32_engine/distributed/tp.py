"""Tensor-parallel checks around each forward: every rank must plan the same batch.

A tensor-parallel rank whose plan differs from its peers computes garbage or hangs in
the next collective. Two checks catch it where it starts:

- always on: the batch signature (step, mode, requests, longest KV length, query
  tokens) is checked before the forward with one all-reduce of ten int64
  (:func:`distributed.agree.check_equal`), on the host group: no device sync;
- debug (``digests=True``): after the forward, a content digest of every plan field
  (``planner.debug.plan_digests``, plus the scalars) is all-gathered, and a rank
  whose digest differs from rank 0's raises, naming the rank and the field. It reads
  the plans after the graph replayed, so ops recorded in the graph are covered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from dsv32_engine.distributed.agree import RankMismatch, check_equal
from dsv32_engine.distributed.group import DistContext
from planner.batch import ForwardBatch, ForwardMode
from planner.debug import plan_digests
from planner.schema import Plan

SIGNATURE = ("step", "mode", "bs", "max_len", "tokens")
MODES = tuple(ForwardMode)


def batch_signature(batch: ForwardBatch, step: int) -> list[int]:
    """What every tensor-parallel rank's batch must share, as integers (``SIGNATURE``)."""
    lens = batch.seq_lens_cpu
    longest = int(lens.max()) if lens.numel() else 0
    return [step, MODES.index(ForwardMode(batch.mode)), batch.bs, longest, batch.num_tokens]


def _show(name: str, value: int) -> object:
    return MODES[value].value if name == "mode" and 0 <= value < len(MODES) else value


def field_digests(plans: Mapping[str, Plan]) -> dict[str, str]:
    """Content digest of every tensor field, and the value of every scalar, by ``backend.field``."""
    out = plan_digests(plans)
    for backend, plan in plans.items():
        for name in plan.scalar_specs:
            out[f"{backend}.{name}"] = repr(getattr(plan, name))
    return out


@dataclass
class TPCheck:
    """The per-forward checks of one tensor-parallel rank; counts what it checked."""

    ctx: DistContext
    digests: bool = False
    steps: int = 0
    digest_steps: int = 0

    def before(self, batch: ForwardBatch) -> None:
        """The signature check: one small all-reduce; raises on every rank on a mismatch."""
        sig = batch_signature(batch, self.steps)
        check_equal(sig, SIGNATURE, self.ctx.host_group, what="batch", show=_show)
        self.steps += 1

    def after(self, plans: Mapping[str, Plan]) -> None:
        """Debug: every plan field's digest equals rank 0's (one all-gather of the digests)."""
        if not self.digests:
            return
        mine = field_digests(plans)
        every: list[dict[str, str] | None] = [None] * self.ctx.world
        dist.all_gather_object(every, mine, group=self.ctx.host_group)
        first = every[0] or {}
        for rank, theirs in enumerate(every):
            theirs = theirs or {}
            keys = sorted(set(first) | set(theirs))
            bad = [k for k in keys if first.get(k) != theirs.get(k)]
            if bad:
                raise RankMismatch(
                    f"tensor-parallel rank {rank} planned {bad[0]} differently from rank 0 at "
                    f"step {self.steps - 1} (differing fields: {bad})",
                    field=bad[0],
                    expected="rank 0's digest",
                    actual=f"rank {rank}'s",
                )
        self.digest_steps += 1
