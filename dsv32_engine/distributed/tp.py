"""Tensor-parallel checks around each forward: every rank must plan the same batch.

A tensor-parallel rank whose plan differs from its peers computes garbage or hangs in
the next collective. Two checks catch it where it starts:

- always on: the batch signature (step, mode, requests, longest KV length, query
  tokens, tokens per request, the run's draft steps, and a digest of the batch's host
  tensors: every length, slot and position) is checked before the forward with one
  all-reduce of sixteen int64 (:func:`distributed.agree.check_equal`), on the host group:
  no device sync. Target and draft forwards alike (verify, draft extend, draft decode);
- debug (``digests=True``): after the forward, a content digest of every plan field
  (``planner.debug.plan_digests``, plus the scalars; every step of a draft decode) and of
  the forward's inputs (token ids, the draft's hidden states) is all-gathered, and a
  rank whose digest differs from rank 0's raises, naming the rank and the field. It
  reads the plans after the graph replayed, so ops recorded in the graph are covered.

Speculative decoding's accept decisions are computed identically on every rank, not
broadcast: the logits come out of the heads' all-reduce, which hands every rank the same
sum, and everything after it is replicated, so every rank's argmax and acceptance are the
same. Nothing has to trust that: a rank that accepted differently feeds other lengths and
positions into its next forward, whose signature check then fails on every rank, naming
``batch.batch_digest`` (tested by making one rank accept one token less).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv32_engine.distributed.agree import RankMismatch, check_equal
from dsv32_engine.distributed.group import DistContext
from planner.batch import ForwardBatch, ForwardMode
from planner.debug import plan_digests, tensor_digest
from planner.schema import Plan

SIGNATURE = ("step", "mode", "bs", "max_len", "tokens", "next_n", "draft_steps", "batch_digest")
MODES = tuple(ForwardMode)
HOST_FIELDS = ("req_pool_indices", "out_cache_loc", "positions")
"""Batch tensors the digest covers when they live on the host (the engine's do); the lengths
always do."""


def batch_digest(batch: ForwardBatch) -> int:
    """63 bits of blake2b over the batch's host tensors: lengths, new tokens, and the pool
    rows, slots and positions when on the host (reading device ones would sync)."""
    h = hashlib.blake2b(digest_size=8)
    tensors = [batch.seq_lens_cpu, batch.new_tokens(), *(getattr(batch, f) for f in HOST_FIELDS)]
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cpu":
            h.update(tensor.numpy().tobytes())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little") >> 1


def batch_signature(batch: ForwardBatch, step: int, draft_steps: int = 0) -> list[int]:
    """What every tensor-parallel rank's batch must share, as integers (``SIGNATURE``)."""
    lens = batch.seq_lens_cpu
    longest = int(lens.max()) if lens.numel() else 0
    mode = MODES.index(ForwardMode(batch.mode))
    digest = batch_digest(batch)
    return [step, mode, batch.bs, longest, batch.num_tokens, batch.next_n, draft_steps, digest]


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
    draft_steps: int = 0
    """The run's draft-decode steps per round: a setting every rank must share."""
    steps: int = 0
    digest_steps: int = 0
    by_mode: Counter = field(default_factory=Counter)
    """Forwards checked, by mode (draft forwards included)."""

    def before(self, batch: ForwardBatch) -> None:
        """The signature check: one small all-reduce; raises on every rank on a mismatch."""
        sig = batch_signature(batch, self.steps, self.draft_steps)
        check_equal(sig, SIGNATURE, self.ctx.host_group, what="batch", show=_show)
        self.steps += 1
        self.by_mode[ForwardMode(batch.mode).value] += 1

    def after(
        self, plans: Mapping[str, Plan], inputs: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Debug: every plan field's digest, and every input's, equals rank 0's (one
        all-gather of the digests)."""
        if not self.digests:
            return
        mine = field_digests(plans)
        mine.update({f"input.{k}": tensor_digest(v) for k, v in (inputs or {}).items()})
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
