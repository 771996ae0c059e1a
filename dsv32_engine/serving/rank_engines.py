"""Decode engines of one rank among several: tensor parallel and data-parallel attention.

Both are a :class:`DecodeEngine` with one planner per rank; what they add is around
each forward (``distributed.tp``, ``distributed.dp``), so the single-rank engine stays
the one loop there is.

- :class:`TPEngine`: every rank serves the same workload with its share of the attention
  heads (``wo``'s partial sums all-reduced in every layer); before each forward the batch
  signature is agreed (one small all-reduce), after it, in debug mode, the plans' digests.
- :class:`DPEngine`: each rank serves its share of the workload; once per loop step the
  ranks agree on which forwards run and at which graph size, ranks without a batch run
  IDLE batches, and every layer's FFN exchanges rows with the peers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from dsv32_engine.distributed.dp import Decision, Slot, agree
from dsv32_engine.distributed.exchange import HeadReduce, RowExchange
from dsv32_engine.distributed.group import DistContext
from dsv32_engine.distributed.tp import TPCheck
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.engine import DecodeEngine, RunResult
from dsv32_engine.serving.model_setup import build_model, model_config, resolve_device
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.run_config import RunConfig
from graphs.runner import PEER_EAGER
from planner.batch import ForwardBatch, ForwardMode


class TPEngine(DecodeEngine):
    """One tensor-parallel rank: its share of the attention heads (``wo``'s partial sums
    all-reduced in every layer), the same batches as its peers, proven so every forward."""

    def __init__(
        self,
        config: RunConfig,
        ctx: DistContext,
        *,
        model: DSV32Model | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            model = build_model(config, model_config(config.model), resolve_device(config.device))
        self.reduce = HeadReduce(ctx)
        model.shard_attention_heads(ctx.rank, ctx.world, self.reduce)
        super().__init__(config, model=model, **kwargs)
        self.ctx = ctx
        digests = config.distributed.digests
        self.check = TPCheck(ctx, digests=config.planner.debug if digests is None else digests)

    def _run_forward(self, batch: ForwardBatch, ids: torch.Tensor) -> Any:
        self.check.before(batch)
        out = super()._run_forward(batch, ids)
        self.check.after(self.runner.last_plans)
        return out

    def rank_summary(self) -> dict[str, Any]:
        return {
            "signature_checks": self.check.steps,
            "digest_checks": self.check.digest_steps,
            "verified_replays": self.planner.stats.verified,
            "attention_heads": self.model.attention_heads,
            "head_all_reduces": self.reduce.calls,
            "warm_up_forwards": self.warm_up_forwards,
        }


class DPEngine(DecodeEngine):
    """One data-parallel attention rank: its own requests, its peers' step and graph size."""

    SLOTS = 2
    """Forwards a loop step may run: the extend (or mixed) batch, then the decode batch."""

    def __init__(self, config: RunConfig, ctx: DistContext, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.ctx = ctx
        self.exchange = RowExchange(ctx)
        self.model.set_ffn_exchange(self.exchange)
        self._decision: Decision | None = None
        self._active = True
        self._all_done = False
        self.loop_steps = 0
        self.idle_forwards = 0
        self.peer_eager = 0
        self.sizes: Counter = Counter()
        """Forwards by agreed graph size (``eager`` for slots all ranks ran eagerly)."""
        self.trace: list[tuple[int, int, str, int, str, int]] | None = None
        """Set to a list to record every forward: (loop step, slot, mode, own requests,
        phase the plans were made in, their padded size: requests, or a ragged plan's token
        bucket). Tests compare it across ranks."""

    def workload(self) -> list[Request]:
        everything = super().workload()
        world, rank = self.ctx.world, self.ctx.rank
        if self.config.distributed.dp_split == "blocks":
            n = len(everything)
            return everything[rank * n // world : (rank + 1) * n // world]
        return everything[rank::world]

    def _more(self, local: bool) -> bool:
        self._active = local
        return not self._all_done

    def _run_forward(self, batch: ForwardBatch, ids: torch.Tensor) -> Any:
        decision = self._decision
        if decision is None:  # warm-up forwards: the same on every rank, outside the loop
            return super()._run_forward(batch, ids)
        inputs = {"input_ids": ids}
        if decision.size is not None:  # requests, or a ragged slot's tokens
            return self.runner.step(batch, inputs, at_least=decision.size)
        ragged = ForwardMode(batch.mode).ragged
        self.peer_eager += not ragged
        return self.runner.step(batch, inputs, eager=None if ragged else PEER_EAGER)

    def step(self, result: RunResult) -> list[Request]:
        """One agreed loop step: at most an extend (or mixed) forward, then a decode forward,
        each run by every rank (an IDLE batch where a rank has none) or by none."""
        sched = self.scheduler
        work = self._prefill_work(sched.running)
        prefilling = {id(r) for r, _ in work}
        decoding = [r for r in sched.running if not r.prefilling and id(r) not in prefilling]
        mode = ForwardMode.EXTEND
        if work and decoding and self.config.loop.mixed:
            work, decoding, mode = work + [(r, 1) for r in decoding], [], ForwardMode.MIXED
        kv = sum(r.fed + n for r, n in work)  # the extend batch's KV: its lengths' sum
        slots = (
            Slot(mode, len(work), sum(n for _, n in work), kv) if work else Slot(),
            Slot(ForwardMode.DECODE, len(decoding), len(decoding)) if decoding else Slot(),
        )
        plan = agree(self.ctx, self.loop_steps, self._active, slots, self.runner.route)
        self.loop_steps += 1
        self._all_done = not plan.active
        try:
            for index, decision in enumerate(plan.slots):
                if not decision.run:
                    continue
                self._decision = decision
                self.exchange.rows = None if decision.size is not None else decision.max_rows
                self.sizes["eager" if decision.size is None else decision.size] += 1
                own = len(work) if index == 0 else len(decoding)
                if index == 0 and work:
                    self._extend_step(work, mode, result)
                elif index == 1 and decoding:
                    self._decode_step(decoding, result)
                else:
                    peers = {ForwardMode(m) for m in decision.modes if m != "idle"}
                    ragged = next((m for m in peers if m.ragged), None)
                    if ragged is not None and decision.size is not None:
                        batch, ids = sched.idle_ragged(ragged)  # the peers' token bucket
                    else:
                        batch, ids = sched.idle()
                    self._forward_step(batch, ids, result)
                    self.idle_forwards += 1
                if self.trace is not None:
                    plans = self.runner.last_plans
                    step, kind = self.loop_steps - 1, plans.mode.value
                    size = plans.reqs if plans.tokens is None else plans.tokens
                    self.trace.append((step, index, kind, own, plans.phase, size))
        finally:
            self._decision, self.exchange.rows = None, None
        return [r for r in sched.running if r.done]

    def rank_summary(self) -> dict[str, Any]:
        return {
            "loop_steps": self.loop_steps,
            "verified_replays": self.planner.stats.verified,
            "idle_forwards": self.idle_forwards,
            "peer_eager_forwards": self.peer_eager,
            "ffn_exchanges": self.exchange.calls,
            "forwards_by_size": {str(k): v for k, v in sorted(self.sizes.items(), key=str)},
            "replays_by_size": {
                f"{mode}:{bs}": n for (mode, bs), n in sorted(self.runner.stats.replays.items())
            },
        }
