"""Speculative decoding in the loop: target verify -> accept -> draft extend -> draft decode.

Each decode step of a request is one round. The target verifies ``n`` rows (its last
token and ``n - 1`` drafts) in one graph replay; greedy acceptance keeps the drafts it
agrees with and its own next token (``serving.accept``), so the tokens are exactly plain
greedy decoding's. Then the draft proposes the next round's ``n - 1`` tokens:

- ``ngram``: prompt lookup over the request's tokens, on the host (``serving.ngram``);
- ``mtp``: DeepSeek-V3.2's MTP layer (``models.mtp``). A draft extend (its own graph)
  catches the layer up on each request's accepted tokens with the target's hidden states
  of those rows and yields the first draft; one draft-decode graph then runs the other
  ``n - 2`` steps, each over its own plan. A request that finishes its prompt is caught
  up by a draft prefill over the same extend plans as the target's chunk.

Every draft batch goes through the planner and a graph runner like the target's, so the
bugs the planner exists to rule out (stale schedules, wrong padded row counts, lengths
from the wrong counts) are ruled out here too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import MTPDraft
from dsv32_engine.serving.accept import accept_greedy
from dsv32_engine.serving.ngram import NgramDraft
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.run_config import GraphsSection, SpeculativeSection
from dsv32_engine.serving.scheduler import Scheduler, slot_for
from graphs import GraphRunner
from graphs.inputs import InputSpec
from planner.batch import ForwardBatch, ForwardMode
from planner.planner import Planner
from planner.plans import PlanSet

TargetStep = Callable[[ForwardBatch, torch.Tensor], Any]
"""``step(batch, input_ids)``: one target forward through the engine's graph runner."""
RunStep = Callable[[GraphRunner, ForwardBatch, dict[str, torch.Tensor]], Any]
"""``run(runner, batch, inputs)``: how the engine runs a forward through a graph runner (a
rank of several checks it and replays the agreed size); draft forwards go through it too."""


def _step(runner: GraphRunner, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> Any:
    return runner.step(batch, inputs)


@dataclass
class SpecStats:
    """What speculation did: verify rounds, accepted tokens, draft forwards."""

    verify_steps: int = 0
    verified_requests: int = 0
    accepted_tokens: int = 0
    """Tokens verify accepted (drafts the target agreed with, plus its own), before budgets."""
    draft_forwards: Counter = field(default_factory=Counter)
    """Draft forwards by kind: draft_prefill (eager, over a prompt chunk's plans), draft_extend,
    draft_decode (graphs)."""


class Speculation:
    """One engine's speculative decoding; see the module docstring."""

    def __init__(
        self,
        spec: SpeculativeSection,
        *,
        planner: Planner,
        model: DSV32Model,
        scheduler: Scheduler,
        num_pages: int,
        graphs: GraphsSection,
        run: RunStep = _step,
    ) -> None:
        self.spec = spec
        self.planner = planner
        self.run = run
        self.n = spec.draft_tokens
        self.steps = spec.decode_steps
        self.scheduler = scheduler
        self.stats = SpecStats()
        self.ngram = NgramDraft(spec.ngram_min, spec.ngram_max) if spec.draft == "ngram" else None
        self.mtp: MTPDraft | None = None
        self.runners: dict[ForwardMode, GraphRunner] = {}
        self._pending: list[tuple[Request, torch.Tensor, torch.Tensor]] = []
        self._catch_up: tuple[list[tuple[Request, int, int]], torch.Tensor, torch.Tensor] | None
        self._catch_up = None
        """The last verify's accepted tokens for the draft extend: (request, first position,
        accepted), their ids and the target's hidden rows (copied out of the graph's output)."""
        if spec.draft == "mtp":
            self.mtp = MTPDraft(model, seed=spec.mtp_seed)
            planner.check_serves(MTPDraft.PLANS, who="the MTP draft")
            self.cache = self.mtp.new_cache(num_pages)
            modes = [ForwardMode.DRAFT_EXTEND] + ([ForwardMode.DRAFT_DECODE] if self.steps else [])
            for mode in modes:
                per = "rows" if mode is ForwardMode.DRAFT_EXTEND else "reqs"
                dim = model.config.hidden_size
                self.runners[mode] = GraphRunner(
                    planner,
                    self._draft_forward,
                    req_to_token=scheduler.pool.req_to_token,
                    static_inputs={
                        "input_ids": InputSpec(torch.int64, per=per),
                        "hidden": InputSpec(model.dtype, (dim,), per=per),
                    },
                    modes=[mode],
                    sizes=graphs.sizes,
                    enabled=graphs.enabled if isinstance(graphs.enabled, bool) else True,
                )

    @property
    def wants_hidden(self) -> bool:
        """Whether the target must return its hidden states (the MTP draft reads them)."""
        return self.mtp is not None

    def _draft_forward(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> Any:
        return self.mtp(inputs["input_ids"], inputs["hidden"], plans, self.cache)

    def capture(self) -> None:
        for runner in self.runners.values():
            runner.capture()

    # ---- the draft prefill: after a target prompt chunk ----------------------------------

    def prefilled(
        self,
        work: list[tuple[Request, int]],
        firsts: list[int],
        plans: PlanSet,
        hidden: torch.Tensor,
    ) -> None:
        """Run the MTP layer over a prompt chunk the target just read (pairs ``(h_p, t_p+1)``
        at the chunk's positions, with its plans); queue requests whose prompt is done."""
        if self.mtp is None:
            return
        ids = [
            r.tokens[p + 1] for (r, n), first in zip(work, firsts) for p in range(first, first + n)
        ]
        ids_t = torch.tensor(ids, dtype=torch.int64, device=hidden.device)
        hidden = hidden.to(self.mtp.dtype)
        rows = plans["nsa"].positions.shape[0]
        if rows > len(ids):
            # The target replayed a ragged graph (its plans hold a token bucket), or this is
            # a data-parallel rank's idle batch in its peers' prompt-chunk forward: the draft
            # reads those plans with padding rows too (token 0, a zero state; their KV goes
            # to the null slot, their outputs are never read).
            pad = rows - len(ids)
            ids_t = torch.nn.functional.pad(ids_t, (0, pad))
            hidden = torch.nn.functional.pad(hidden[: len(ids)], (0, 0, 0, pad))
        out = self.mtp(ids_t, hidden, plans, self.cache)
        if work:
            self.stats.draft_forwards["draft_prefill"] += 1
        for i, (request, _) in enumerate(work):
            if not request.prefilling and not request.done:
                self._pending.append((request, out["tokens"][i], out["hidden"][i]))

    # ---- a round: verify, accept, draft extend ---------------------------------------------

    def _drafts(self, request: Request) -> list[int]:
        if self.ngram is not None:
            return self.ngram.propose(request.rid, request.tokens, self.n - 1)
        return request.drafts

    def verify(
        self, requests: list[Request], target_step: TargetStep, now: Callable[[], float]
    ) -> int:
        """Verify every request's drafts, keep what greedy decoding would; the tokens kept."""
        drafts = [self._drafts(r) for r in requests]
        slot = slot_for(self.planner, ForwardMode.TARGET_VERIFY)
        batch, ids = self.scheduler.build(
            requests, ForwardMode.TARGET_VERIFY, self.n, drafts, inputs=slot
        )
        out = target_step(batch, ids)
        best = self.planner.read(out["tokens"].view(len(requests), self.n))
        t = now()
        kept, catch_up = 0, []
        for j, (request, row) in enumerate(zip(requests, best)):
            accepted = accept_greedy(drafts[j], row)
            first = request.fed
            before = len(request.generated)
            for token in accepted:
                request.take(token, t)
            request.fed += len(accepted)
            del request.generated[request.max_new_tokens :]
            kept += len(request.generated) - before
            self.stats.accepted_tokens += len(accepted)
            if not request.done:
                catch_up.append((j, request, first, accepted))
        self.stats.verify_steps += 1
        self.stats.verified_requests += len(requests)
        if self.mtp is not None and catch_up:
            hidden = out["hidden"]
            rows = [j * self.n + i for j, _, _, acc in catch_up for i in range(len(acc))]
            index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
            ids = torch.tensor([t for *_, acc in catch_up for t in acc], dtype=torch.int64)
            work = [(r, f, len(a)) for _, r, f, a in catch_up]
            self._catch_up = (work, ids.to(hidden.device), hidden[index].to(self.mtp.dtype))
        return kept

    def draft_sizes(self) -> tuple[int, int]:
        """Requests of this step's draft extend and draft decode (0: none to run); what a
        data-parallel rank tells its peers before those forwards."""
        extend = len(self._catch_up[0]) if self._catch_up is not None else 0
        decode = sum(not r.done for r, _, _ in self._pending) + extend if self.steps else 0
        return extend, decode

    def draft_extend(self) -> None:
        """The MTP layer over each request's accepted tokens of the last verify, with the
        target's hidden state of the rows they were accepted at; its outputs start the draft
        decode."""
        if self._catch_up is None:
            return
        work, ids, hidden = self._catch_up
        self._catch_up = None
        batch = self.scheduler.build_draft_extend(work, self.n)
        runner = self.runners[ForwardMode.DRAFT_EXTEND]
        out = self.run(runner, batch, {"input_ids": ids, "hidden": hidden})
        self.stats.draft_forwards["draft_extend"] += 1
        for i, (request, _, _) in enumerate(work):
            self._pending.append((request, out["tokens"][i].clone(), out["hidden"][i].clone()))

    # ---- the draft decode: every request caught up this step --------------------------------

    def finish_step(self) -> None:
        """Draft decode for every request the draft caught up this step: its next drafts."""
        pending = [(r, t, h) for r, t, h in self._pending if not r.done]
        self._pending = []
        if not pending:
            return
        first = torch.stack([t for _, t, _ in pending])
        if not self.steps:
            for (request, _, _), token in zip(pending, first.tolist()):
                request.drafts = [token]
            return
        requests = [r for r, _, _ in pending]
        batch = self.scheduler.build_draft_decode(requests, self.steps)
        inputs = {"input_ids": first, "hidden": torch.stack([h for _, _, h in pending])}
        out = self.run(self.runners[ForwardMode.DRAFT_DECODE], batch, inputs)
        self.stats.draft_forwards["draft_decode"] += 1
        rests = self.runners[ForwardMode.DRAFT_DECODE].read(out["tokens"])
        for request, token, rest in zip(requests, first.tolist(), rests):
            request.drafts = [token, *rest]

    def forget(self, request: Request) -> None:
        """A finished request's draft state goes with it."""
        if self.ngram is not None:
            self.ngram.forget(request.rid)

    def summary(self) -> dict[str, Any]:
        s = self.stats
        graphs = {mode.value: r.stats.summary()["graph_steps"] for mode, r in self.runners.items()}
        return {
            "draft": self.spec.draft,
            "draft_tokens": self.n,
            "verify_steps": s.verify_steps,
            "mean_accept_length": s.accepted_tokens / s.verified_requests
            if s.verified_requests
            else 0.0,
            "accepted_tokens_per_verify_step": s.accepted_tokens / s.verify_steps
            if s.verify_steps
            else 0.0,
            "draft_forwards": dict(sorted(s.draft_forwards.items())),
            "draft_graph_replays": graphs,
        }
