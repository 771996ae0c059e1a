"""The decode engine of one rank among several: tensor parallel, data-parallel attention, both.

A job of ``tp x dp_attention`` ranks (``distributed.group.split``): rank ``r`` is TP rank
``r % tp`` of DP replica ``r // tp``. :class:`RankEngine` is a :class:`DecodeEngine` with
one planner per rank; what it adds is around each forward (``distributed.tp``,
``distributed.dp``), so the single-rank engine stays the one loop there is.

- Tensor parallel (``tp > 1``): the TP ranks of a replica serve the same requests, each with
  its share of the attention heads, the MTP draft's too (``wo``'s partial sums all-reduced in
  every layer). Before every forward, target and draft alike, the batch signature is agreed
  (one small all-reduce); after it, in debug mode, the plans' and inputs' digests.
- Data-parallel attention (``dp_attention > 1``): each replica serves its share of the
  workload; once per loop step the replicas agree on which forwards run and at which graph
  size, and once more, under an MTP draft, on the draft extend and draft decode. A replica
  without a batch in a forward runs an IDLE batch of that forward's shape (decode, verify,
  draft extend or draft decode: never a decode-shaped one in a verify's place), and every
  layer's FFN, the draft's included, exchanges rows with the other replicas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsv32_engine.distributed.dp import Decision, Slot, agree
from dsv32_engine.distributed.exchange import HeadReduce, RowExchange
from dsv32_engine.distributed.group import DistContext, split
from dsv32_engine.distributed.tp import TPCheck
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.model_setup import build_model, model_config, resolve_device
from dsv32_engine.serving.report import runners
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.run_config import RunConfig
from dsv32_engine.serving.run_result import RunResult
from graphs import GraphRunner
from graphs.runner import PEER_EAGER
from planner.batch import ForwardBatch, ForwardMode

DRAFT_MODES = (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE)

STOP_AGREE_EVERY = 8
"""Loop steps between the ranks' agreements on Ctrl-C: one small host all-reduce per this
many steps (a fraction of a millisecond on gloo, against steps of tens of milliseconds), and
Ctrl-C answered within as many steps."""


class RankEngine(DecodeEngine):
    """One rank of a ``tp x dp_attention`` job: see the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        ctx: DistContext,
        *,
        model: DSV32Model | None = None,
        **kwargs: Any,
    ) -> None:
        d = config.distributed
        tp_ctx, dp_ctx = split(ctx, d.tp, d.dp_attention)
        if model is None:
            model = build_model(config, model_config(config.model), resolve_device(config.device))
        self.reduce = HeadReduce(tp_ctx) if tp_ctx is not None else None
        if tp_ctx is not None:
            model.shard_attention_heads(tp_ctx.rank, tp_ctx.world, self.reduce)
        super().__init__(config, model=model, **kwargs)
        self.ctx, self.tp_ctx, self.dp_ctx = ctx, tp_ctx, dp_ctx
        mtp = self.speculation.mtp if self.speculation is not None else None
        self.check: TPCheck | None = None
        if tp_ctx is not None:
            if mtp is not None:
                mtp.shard_attention_heads(tp_ctx.rank, tp_ctx.world, self.reduce)
            digests = config.planner.debug if d.digests is None else d.digests
            steps = config.speculative.decode_steps
            self.check = TPCheck(tp_ctx, digests=digests, draft_steps=steps)
        self.exchange = RowExchange(dp_ctx) if dp_ctx is not None else None
        if self.exchange is not None:
            self.model.set_ffn_exchange(self.exchange)
            if mtp is not None:
                mtp.set_ffn_exchange(self.exchange)
        self._decision: Decision | None = None
        self._in_step = False
        self._active = True
        self._all_done = False
        self.loop_steps = 0
        self.idle_forwards = 0
        self.idle_by_shape: Counter = Counter()
        """IDLE forwards by the shape they padded (decode, target_verify, draft_extend, ...)."""
        self.peer_eager = 0
        self.sizes: Counter = Counter()
        """Forwards by agreed graph size (``eager`` for slots all replicas ran eagerly)."""
        self.trace: list[tuple[int, int, str, int, str, int]] | None = None
        """Set to a list to record every agreed forward: (loop step, slot, mode, own
        requests, phase the plans were made in, their padded size: requests, or a ragged
        plan's token bucket). Tests compare it across ranks."""

    # ---- every forward ---------------------------------------------------------------------

    def _run(
        self, runner: GraphRunner, batch: ForwardBatch, inputs: dict[str, torch.Tensor]
    ) -> Any:
        if self.check is not None:
            self.check.before(batch)
        decision = self._decision
        if decision is None:  # no DP, or forwards every rank runs alike (warm-up)
            out = runner.step(batch, inputs)
        elif decision.size is not None:  # requests, or a ragged slot's tokens
            out = runner.step(batch, inputs, at_least=decision.size)
        else:  # some replica's batch fits no graph: every replica runs this slot eagerly
            # (a ragged batch with ragged graphs off is eager anyway, not for a peer)
            own = ForwardMode(batch.mode).ragged and not runner.token_sizes
            self.peer_eager += not own
            out = runner.step(batch, inputs, eager=None if own else PEER_EAGER)
        if self.check is not None:
            self.check.after(runner.last_plans, inputs)
        return out

    def _draft_extend(self) -> None:
        if not self._in_step:  # data-parallel: in its own agreed slot (see step)
            super()._draft_extend()

    def _stopping(self, step: int, stop: Callable[[], bool] | None) -> bool:
        """Ctrl-C, agreed: every :data:`STOP_AGREE_EVERY` loop steps the ranks all-reduce
        whether any of them was asked to stop, so all stop before the same step (a rank that
        stopped alone would leave its peers waiting in the next collective). Every rank runs
        the same loop steps (data-parallel ranks agree on them; TP ranks serve one workload),
        so they all reach each check; a job run without ``stop`` makes none."""
        if stop is None or self.ctx.world == 1:
            return super()._stopping(step, stop)
        if step % STOP_AGREE_EVERY:
            return False  # between agreements: no rank stops on its own
        flag = torch.tensor([1 if stop() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.host_group)
        return bool(flag.item())

    # ---- data-parallel attention: the agreed step ------------------------------------------

    def workload(self) -> list[Request]:
        everything = super().workload()
        if self.dp_ctx is None:
            return everything
        world, rank = self.dp_ctx.world, self.dp_ctx.rank
        if self.config.distributed.dp_split == "blocks":
            n = len(everything)
            return everything[rank * n // world : (rank + 1) * n // world]
        return everything[rank::world]

    def _more(self, local: bool) -> bool:
        if self.dp_ctx is None:
            return local
        self._active = local
        return not self._all_done

    def _route(
        self, mode: ForwardMode, bs: int, tokens: int, kv_tokens: int
    ) -> tuple[int | None, str | None]:
        """The graph size a slot replays, from the runner that runs that mode."""
        runner = self.speculation.runners[mode] if mode in DRAFT_MODES else self.runner
        return runner.route(mode, bs, tokens, kv_tokens)

    def step(self, result: RunResult) -> list[Request]:
        """One loop step. Without data-parallel attention: the single-rank step. With it: at
        most an extend (or mixed) forward, then a decode (or verify) forward, and under an
        MTP draft a draft extend and a draft decode, each run by every replica (an IDLE
        batch of its shape where one has none) or by none."""
        if self.dp_ctx is None:
            return super().step(result)
        sched, spec = self.scheduler, self.speculation
        previous = self._begin_step()
        work, mode, decoding = self._step_work()
        target, n = self.decode_mode, self.limits.next_n
        kv = sum(r.fed + k for r, k in work)  # the extend batch's KV: its lengths' sum
        slots = (
            Slot(mode, len(work), sum(k for _, k in work), kv) if work else Slot(),
            Slot(target, len(decoding), len(decoding) * n) if decoding else Slot(),
        )
        plan = agree(self.dp_ctx, self.loop_steps, self._active, slots, self._route)
        self.loop_steps += 1
        self._all_done = not plan.active
        self._in_step = True
        try:
            if self._slot(0, plan.slots[0], len(work)):
                if work:
                    self._extend_step(work, mode, result)
                else:
                    self._idle_extend(plan.slots[0], result)
                self._traced(0, len(work))
            if self._slot(1, plan.slots[1], len(decoding)):
                if decoding:
                    self._decode_step(decoding, result)
                else:
                    batch, ids = sched.idle(target, n)  # the peers' decode or verify shape
                    self._forward_step(batch, ids, result)
                    self._idled(target)
                self._traced(1, len(decoding))
            if spec is not None and spec.mtp is not None:
                self._draft_slots(result)
            elif spec is not None:
                spec.finish_step()  # an n-gram draft: no forward
        finally:
            self._decision, self._in_step = None, False
            if self.exchange is not None:
                self.exchange.rows = None
        return self._end_step(previous, result)

    def _slot(self, index: int, decision: Decision, own: int) -> bool:
        """Set up one agreed forward; whether it runs at all."""
        if not decision.run:
            return False
        self._decision = decision
        self.exchange.rows = None if decision.size is not None else decision.max_rows
        self.sizes["eager" if decision.size is None else decision.size] += 1
        return True

    def _idle_extend(self, decision: Decision, result: RunResult) -> None:
        """This replica's part of its peers' prompt-chunk forward: the null extend in the
        peers' mode (replayed in their token bucket, or eagerly as they run), else an IDLE
        batch. Under an MTP draft the forward holds the draft's catch-up, whose layer
        exchanges rows too: a null extend runs it as the peers' forwards do."""
        peers = {ForwardMode(m) for m in decision.modes if m != "idle"}
        ragged = next((m for m in peers if m.ragged), None)
        if ragged is not None and (decision.size is not None or self.wants_hidden):
            batch, ids = self.scheduler.idle_ragged(ragged)
            shape = ragged
        else:
            batch, ids = self.scheduler.idle()
            shape = ForwardMode.DECODE
        self._forward_step(batch, ids, result)
        self._idled(shape)

    def _draft_slots(self, result: RunResult) -> None:
        """The MTP draft's two forwards of this step, agreed across replicas: the draft
        extend over the last verify's accepted tokens, then the draft decode."""
        spec = self.speculation
        n, steps = self.limits.next_n, spec.steps
        extend, decode = spec.draft_sizes()
        slots = (
            Slot(ForwardMode.DRAFT_EXTEND, extend, extend * n) if extend else Slot(),
            Slot(ForwardMode.DRAFT_DECODE, decode, decode) if decode else Slot(),
        )  # tokens: the rows each FFN exchange carries (a draft decode's: per step)
        plan = agree(self.dp_ctx, self.loop_steps, self._active, slots, self._route)
        for index, (mode, own, decision) in enumerate(
            zip(DRAFT_MODES, (extend, decode), plan.slots), start=2
        ):
            if not self._slot(index, decision, own):
                continue
            if own and mode is ForwardMode.DRAFT_EXTEND:
                spec.draft_extend()
            elif own:
                spec.finish_step()
            else:
                per = n if mode is ForwardMode.DRAFT_EXTEND else steps
                batch, _ = self.scheduler.idle(mode, per)
                dim = self.model_config.hidden_size
                inputs = {
                    "input_ids": torch.zeros(0, dtype=torch.int64, device=self.device),
                    "hidden": torch.zeros(0, dim, dtype=spec.mtp.dtype, device=self.device),
                }
                self._run(spec.runners[mode], batch, inputs)
                self._idled(mode)
            self._traced(index, own, spec.runners[mode])
        if not plan.slots[1].run:
            spec.finish_step()  # its first drafts without a draft decode (none to run)

    def _idled(self, shape: ForwardMode) -> None:
        self.idle_forwards += 1
        self.idle_by_shape[shape.value] += 1

    def _traced(self, index: int, own: int, runner: GraphRunner | None = None) -> None:
        if self.trace is None:
            return
        plans = (runner or self.runner).last_plans
        size = plans.reqs if plans.tokens is None else plans.tokens
        self.trace.append((self.loop_steps - 1, index, plans.mode.value, own, plans.phase, size))

    def rank_summary(self) -> dict[str, Any]:
        replays = self._replays()
        out: dict[str, Any] = {"warm_up_forwards": self.warm_up_forwards}
        if self.check is not None:
            out.update(
                signature_checks=self.check.steps,
                digest_checks=self.check.digest_steps,
                checks_by_mode=dict(sorted(self.check.by_mode.items())),
                attention_heads=self.model.attention_heads,
                head_all_reduces=self.reduce.calls,
            )
        if self.exchange is not None:
            out.update(
                loop_steps=self.loop_steps,
                idle_forwards=self.idle_forwards,
                idle_by_shape=dict(sorted(self.idle_by_shape.items())),
                peer_eager_forwards=self.peer_eager,
                ffn_exchanges=self.exchange.calls,
                forwards_by_size={str(k): v for k, v in sorted(self.sizes.items(), key=str)},
                replays_by_size=replays,
            )
        return out

    def _replays(self) -> dict[str, int]:
        out: Counter = Counter()
        for runner in runners(self):
            for (mode, bs), count in runner.stats.replays.items():
                out[f"{mode}:{bs}"] += count
        return dict(sorted(out.items()))
