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
  up over its prompt's rows inside the target's own prompt-chunk forward (below).

Mixing (``loop.mixed``), a step with prompt chunks verifies its decoding requests in the
same forward: a mixed batch of prompt chunks and verify rows (``n`` per request), whose head
reads every request's last ``n`` rows (``planner.batch.LOGIT_ROWS_MODES``). The engine
builds and runs it (``DecodeEngine._mixed_verify_step``), :meth:`Speculation.accept` keeps
what greedy decoding would, and one MTP forward over the same plans catches the draft up on
the prompt rows and the verify rows at once, in place of a draft prefill and a draft extend.
That MTP forward runs inside the target's forward of every prompt-chunk or mixed step
(:meth:`Speculation.catch_up`, in its graph where the step replays one): its ids are each
row's next token, staged by the host where it has it (:meth:`Speculation.stage`) and the
target's own token at that row where it does not (a verify row: a row is accepted only where
its token is the target's; the row that ends a prompt), so nothing waits for the host's
acceptance; :meth:`Speculation.caught_up` then takes each request's draft from its last
prompt row or its last accepted row. A step of verify rows alone
stays a verify graph step with its draft extend, as a step of decode rows alone stays a
decode graph step.

The MTP draft's tokens stay on the device: the next verify feeds them from there
(``TokenIds.draft_of``), and the host reads them with that verify's tokens, so the loop
waits once a round (for the verify), not again for its drafts (:meth:`Speculation.finish_step`).

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
from planner.step_reads import PendingRead

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
    mixed_verify_steps: int = 0
    """Verify rounds run inside a mixed step, beside prompt chunks (of ``verify_steps``)."""
    accepted_tokens: int = 0
    """Tokens verify accepted (drafts the target agreed with, plus its own), before budgets."""
    draft_forwards: Counter = field(default_factory=Counter)
    """Draft forwards by kind: draft_prefill (inside a prompt-chunk step's forward, over its
    plans), draft_mixed (inside a mixed step's forward: its prompt rows and verify rows),
    draft_extend, draft_decode (their own graphs)."""


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
        self._pending: list[tuple[list[Request], torch.Tensor, torch.Tensor]] = []
        """Where the next draft decode starts, a group per draft forward this step (a catch-up
        or a draft extend): its requests, their first draft tokens ``[k]`` and hidden states
        ``[k, dim]``, gathered out of that forward's outputs in one op each (a copy: a graph's
        outputs are rewritten by its next replay). Only requests not done: each step accepts
        before its draft forwards, so none finishes while it waits here."""
        self._reads: list[tuple[list[Request], PendingRead]] = []
        """The MTP draft's proposals on their way to the host, by request: taken by the next
        verify's acceptance (:meth:`_values`)."""
        self._catch_up: tuple[list[tuple[Request, int, int]], torch.Tensor, torch.Tensor] | None
        self._catch_up = None
        """The last verify's accepted tokens for the draft extend: (request, first position,
        accepted), their ids and the target's hidden rows (copied out of the graph's output)."""
        self.next_ids: torch.Tensor | None = None
        """Per row of a prompt-chunk or mixed step, the token after it where the host has it,
        else -1 (:meth:`stage`): read inside the target's forward, in its graph, so a static
        buffer of the step budget's rows; a bucket's padding rows read stale ids, and their
        KV goes to the null slot. Not one of the runner's static inputs: those are copied in
        for every step, and decode and verify steps, most of them, read no catch-up."""
        if spec.draft == "mtp":
            self.mtp = MTPDraft(model, seed=spec.mtp_seed)
            planner.check_serves(MTPDraft.PLANS, who="the MTP draft")
            self.cache = self.mtp.new_cache(num_pages)
            rows = planner.limits.extend_tokens
            self.next_ids = torch.zeros(rows, dtype=torch.int64, device=planner.device)
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

    # ---- the draft's catch-up inside a target prompt-chunk or mixed forward ------------------

    def stage(
        self,
        work: list[tuple[Request, int]],
        firsts: list[int],
        drafts: list[list[int] | None] | None = None,
    ) -> None:
        """Before a target prompt-chunk or mixed forward: each row's next token into
        :attr:`next_ids`, where the host has it (a prompt row's next prompt token), else -1
        (a verify row, ``drafts[i]`` not None; the row that ends a prompt), where
        :meth:`catch_up` takes the target's own token at that row."""
        if self.next_ids is None:
            return
        ids: list[int] = []
        for i, ((request, n), first) in enumerate(zip(work, firsts)):
            if drafts is not None and drafts[i] is not None:
                ids.extend([-1] * n)
                continue
            known = request.tokens[first + 1 : first + n + 1]
            ids.extend(known)
            ids.extend([-1] * (n - len(known)))
        # Not waiting for the draft forwards the last step left running (``TokenIds.send``).
        self.scheduler.token_ids.send(ids, into=self.next_ids)

    def catch_up(
        self, plans: PlanSet, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Inside the target's forward of a prompt-chunk or mixed step (``plans``; ``tokens``:
        the target's argmax at its logit rows, ``hidden``: its final hidden state of every
        row): the MTP layer over the same rows, each fed ``(h_p, t_p+1)``. The token after a
        row is the staged one (:meth:`stage`), else the target's own at that row: a verify
        row counts only where its draft was the target's token, and the row that ends a
        prompt is a logit row. A rejected row's KV lies past the request's new length and is
        rewritten (by the draft decode, then the next catch-up) before anything reads it.
        Returns the draft's token and hidden state at the logit rows, by request like the
        target's tokens (``[reqs]``, or ``[reqs, n]`` in a speculating mixed batch)."""
        mtp, next_ids = self.mtp, self.next_ids
        if mtp is None or next_ids is None:
            raise RuntimeError("catch_up is the MTP draft's: this speculation has none")
        rows = hidden.shape[0]
        logit_rows = plans["nsa"].logit_rows.long()
        at_rows = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
        at_rows[logit_rows.reshape(-1)] = tokens.reshape(-1)
        staged = next_ids[:rows]
        ids = torch.where(staged >= 0, staged, at_rows)
        out = mtp(ids, hidden.to(mtp.dtype), plans, self.cache)
        shape = tokens.shape
        return {
            "draft_tokens": out["tokens"].view(shape),
            "draft_hidden": out["hidden"].view(*shape, -1),
        }

    def caught_up(
        self,
        work: list[tuple[Request, int]],
        accepted: list[list[int] | None],
        out: dict[str, Any],
        mixed: bool,
    ) -> None:
        """After a prompt-chunk or mixed step: queue, for the draft decode, every request the
        step's catch-up (:meth:`catch_up`, ``out``) caught up and not done, from its last
        prompt row or its last accepted row (``accepted``: a verify request's tokens, None
        for a chunk)."""
        if self.mtp is None:
            return
        tokens, hidden = out["draft_tokens"], out["draft_hidden"]
        per = tokens.shape[1] if tokens.dim() > 1 else 1  # a speculating mixed batch: n rows
        requests, rows = [], []
        for i, ((request, _), taken) in enumerate(zip(work, accepted)):
            if taken is None:
                caught, last = not request.prefilling, per - 1  # a chunk: the prompt's last row
            else:
                caught, last = True, len(taken) - 1
            if caught and not request.done:
                requests.append(request)
                rows.append(i * per + last)
        if requests:  # one gather each, whatever the count
            index = self.scheduler.token_ids.send(rows)
            flat = hidden.reshape(-1, hidden.shape[-1])
            self._pending.append((requests, tokens.reshape(-1)[index], flat[index]))
        if work:
            self.stats.draft_forwards["draft_mixed" if mixed else "draft_prefill"] += 1

    # ---- a round: verify, accept, draft extend ---------------------------------------------

    def drafts(self, request: Request) -> list[int]:
        """The ``n - 1`` drafts ``request``'s next verify feeds: the n-gram draft's tokens, or
        where the MTP draft left its own on the device (``TokenIds.draft_of`` ids; the values
        come with the verify's tokens, :meth:`accept`)."""
        if self.ngram is not None:
            return self.ngram.propose(request.rid, request.tokens, self.n - 1)
        token_ids = self.scheduler.token_ids
        return [token_ids.draft_of(request.pool_idx, i) for i in range(self.n - 1)]

    def _values(self, requests: list[Request], fed: list[list[int]]) -> list[list[int]]:
        """The drafts a verify fed (``fed``), as tokens: an n-gram draft's are what was fed;
        the MTP draft's are read now, their copies started behind the draft forwards that
        proposed them (:meth:`finish_step`), which ran before the verify did."""
        if self.mtp is None:
            return fed
        for proposed, read in self._reads:
            for request, values in zip(proposed, read.get()):
                request.drafts = values
        self._reads = []
        for request in requests:
            if len(request.drafts) != self.n - 1:
                raise RuntimeError(
                    f"request {request.rid} was verified with {len(request.drafts)} drafts "
                    f"proposed, not {self.n - 1}: no draft decode proposed them"
                )
        return [request.drafts for request in requests]

    def verify(
        self, requests: list[Request], target_step: TargetStep, now: Callable[[], float]
    ) -> int:
        """Verify every request's drafts, keep what greedy decoding would; the tokens kept."""
        drafts = [self.drafts(r) for r in requests]
        slot = slot_for(self.planner, ForwardMode.TARGET_VERIFY)
        batch, ids = self.scheduler.build(
            requests, ForwardMode.TARGET_VERIFY, self.n, drafts, inputs=slot
        )
        out = target_step(batch, ids)
        best = self.planner.read(out["tokens"].view(len(requests), self.n))
        firsts = [request.fed for request in requests]
        kept, accepted = self.accept(requests, drafts, best, now())
        if self.mtp is not None:
            catch_up = [
                (j, request, first, taken)
                for j, (request, first, taken) in enumerate(zip(requests, firsts, accepted))
                if not request.done
            ]
            if catch_up:
                hidden, send = out["hidden"], self.scheduler.token_ids.send
                index = send([j * self.n + i for j, _, _, acc in catch_up for i in range(len(acc))])
                ids = send([t for *_, acc in catch_up for t in acc])
                work = [(r, f, len(a)) for _, r, f, a in catch_up]
                self._catch_up = (work, ids, hidden[index].to(self.mtp.dtype))
        return kept

    def accept(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        best: list[list[int]],
        now: float,
        *,
        mixed: bool = False,
    ) -> tuple[int, list[list[int]]]:
        """Greedy acceptance of one verify round (``best``: each request's ``n`` rows'
        argmax; ``mixed``: they were verified in a mixed step): every request takes the
        tokens greedy decoding would and is fed that many, cut to its budget. The tokens
        kept, and each request's accepted tokens (before the cut: the rows it was fed)."""
        kept, taken = 0, []
        for request, drafted, row in zip(requests, self._values(requests, drafts), best):
            accepted = accept_greedy(drafted, row)
            before = len(request.generated)
            for token in accepted:
                request.take(token, now)
            request.fed += len(accepted)
            del request.generated[request.max_new_tokens :]
            kept += len(request.generated) - before
            self.stats.accepted_tokens += len(accepted)
            taken.append(accepted)
        if requests:
            self.stats.verify_steps += 1
            self.stats.mixed_verify_steps += mixed
            self.stats.verified_requests += len(requests)
        return kept, taken

    def draft_sizes(self) -> tuple[int, int]:
        """Requests of this step's draft extend and draft decode (0: none to run); what a
        data-parallel rank tells its peers before those forwards."""
        extend = len(self._catch_up[0]) if self._catch_up is not None else 0
        decode = sum(len(group) for group, _, _ in self._pending) + extend if self.steps else 0
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
        k = len(work)
        self._pending.append(
            ([r for r, _, _ in work], out["tokens"][:k].clone(), out["hidden"][:k].clone())
        )

    # ---- the draft decode: every request caught up this step --------------------------------

    def finish_step(self) -> None:
        """Draft decode for every request the draft caught up this step: its next drafts,
        kept on the device for its next verify (``TokenIds.drafted``) and copied to the host
        for that verify's acceptance, read there; nothing here waits for the device."""
        groups, self._pending = self._pending, []
        if not groups:
            return
        requests = [r for group, _, _ in groups for r in group]
        tokens = torch.cat([t for _, t, _ in groups])
        hidden = torch.cat([h for *_, h in groups])
        drafts = tokens.view(-1, 1)
        if self.steps:
            batch = self.scheduler.build_draft_decode(requests, self.steps)
            inputs = {"input_ids": tokens, "hidden": hidden}
            out = self.run(self.runners[ForwardMode.DRAFT_DECODE], batch, inputs)
            self.stats.draft_forwards["draft_decode"] += 1
            drafts = torch.cat([drafts, out["tokens"].view(len(requests), -1)], dim=1)
        # Nothing waits here: the next verify reads the drafts on the device, the host with
        # its tokens (``_values``).
        token_ids = self.scheduler.token_ids
        token_ids.drafted(token_ids.send([r.pool_idx for r in requests]), drafts)
        self._reads.append((requests, self.planner.read_later(drafts)))

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
            "mixed_verify_steps": s.mixed_verify_steps,
            "mean_accept_length": s.accepted_tokens / s.verified_requests
            if s.verified_requests
            else 0.0,
            "accepted_tokens_per_verify_step": s.accepted_tokens / s.verify_steps
            if s.verify_steps
            else 0.0,
            "draft_forwards": dict(sorted(s.draft_forwards.items())),
            "draft_graph_replays": graphs,
        }
