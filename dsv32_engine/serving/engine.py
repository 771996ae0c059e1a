"""The decode engine: model, KV cache, request pool, planner and graph runner, wired once.

Data flows one way: scheduler batch -> planner -> frozen plans -> graph
runner -> model layers. The engine only feeds tokens and reads logits.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.dump_ring import DumpRing, MismatchDumper
from dsv32_engine.serving.model_setup import build_model, kv_pages, model_config, resolve_device
from dsv32_engine.serving.plan_setup import kernel_name, plan_schemas
from dsv32_engine.serving.requests import Request, make_workload
from dsv32_engine.serving.run_config import GraphsSection, PlannerSection, RunConfig
from dsv32_engine.serving.samples import Samples
from dsv32_engine.serving.scheduler import Scheduler
from dsv32_engine.serving.speculative import Speculation
from graphs import GraphRunner, PulledTransport
from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ConfigError
from planner.limits import Limits
from planner.planner import Planner
from planner.plans import PlanSet


@dataclass(frozen=True)
class DumpSettings:
    """Where a run dumps plans: every ``every``-th decode step (the last ``keep``), and mismatches."""

    directory: Path
    every: int = 1
    keep: int = 8


@dataclass
class RunResult:
    """What a run produced and how fast."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    """Generated tokens by request id: kept only when ``run(keep_tokens=True)`` asks."""
    finished: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    wall_seconds: float = 0.0
    step_seconds: Samples = field(default_factory=Samples)
    """Wall time of each decode (or verify) graph step (the latest ones, and the mean of all)."""
    steps_by_mode: Counter = field(default_factory=Counter)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    ttft_seconds: Samples = field(default_factory=Samples)
    summary: dict = field(default_factory=dict)


class DecodeEngine:
    """Builds everything from a :class:`RunConfig` and runs the request loop."""

    def __init__(
        self,
        config: RunConfig,
        *,
        model: DSV32Model | None = None,
        dumps: DumpSettings | None = None,
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if model is None:
            model = build_model(config, model_config(config.model), self.device)
        self.model = model
        self.model_config = model.config
        page = self.model_config.page_size
        p = config.planner
        pages = kv_pages(config, model, self.device)
        self.cache: PagedKVCache = model.new_cache(pages)
        self.pool = RequestPool(p.max_batch + 1, p.max_context, page_size=page, device=self.device)
        spec = config.speculative
        num_sms = p.num_sms
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 132
            )
        self.limits = Limits(
            max_batch=p.max_batch,
            max_context=p.max_context,
            page_size=page,
            next_n=spec.next_n,
            draft_steps=spec.decode_steps,
            max_tokens=config.loop.chunk_tokens + p.max_batch,  # a chunk plus decode rows (mixed)
            ragged_kv_tokens=p.ragged_kv_tokens,
            num_sms=num_sms,
            kv_slots=self.cache.num_slots,
            device=str(self.device),
        )
        model.set_batch_invariant(p.batch_invariant)
        schemas, options, needs = plan_schemas(
            p.mla_kernel, p.schedule_layout, model, self.device, batch_invariant=p.batch_invariant
        )
        self.mla_kernel = kernel_name(p.mla_kernel, self.device)
        """The sparse MLA kernel decode batches run (``auto`` resolved), for the summary."""
        self.planner = Planner(
            schemas,
            self.limits,
            options=options,
            providers=p.providers,
            debug=p.debug or None,
            ops_in_graph=p.ops_in_graph,
            transport=PulledTransport if _stages_in_graph(p) else None,
            on_mismatch=None if dumps is None else MismatchDumper(dumps.directory / "mismatches"),
        )
        self.planner.check_serves(needs)
        self.dump_ring = (
            None
            if dumps is None
            else DumpRing(dumps.directory, every=dumps.every, keep_last=dumps.keep)
        )
        enabled = config.graphs.enabled
        token_sizes = _token_sizes(config.graphs)
        # What the loop runs: decode (or verify), prefill chunks, and mixed steps if it mixes.
        modes = [ForwardMode.DECODE, *([ForwardMode.TARGET_VERIFY] if spec.next_n > 1 else [])]
        if token_sizes is not None:
            modes += [ForwardMode.EXTEND, *([ForwardMode.MIXED] if config.loop.mixed else [])]
        self.runner = GraphRunner(
            self.planner,
            self._forward,
            req_to_token=self.pool.req_to_token,
            static_inputs={"input_ids": torch.int64},
            modes=modes,
            sizes=config.graphs.sizes,
            token_sizes=token_sizes,
            extend_tokens=config.loop.chunk_tokens,  # prompt chunks; mixed steps add decodes
            enabled=enabled if isinstance(enabled, bool) else True,
        )
        self.scheduler = Scheduler(self.cache, self.pool, p.max_batch, page)
        self.decode_mode = ForwardMode.TARGET_VERIFY if spec.enabled else ForwardMode.DECODE
        self.speculation = (
            Speculation(
                spec,
                planner=self.planner,
                model=model,
                scheduler=self.scheduler,
                num_pages=pages,
                graphs=config.graphs,
                run=self._run,
            )
            if spec.enabled
            else None
        )
        if self.speculation is not None and self.speculation.mtp is not None:
            self.speculation.mtp.set_batch_invariant(p.batch_invariant)
        self.wants_hidden = self.speculation is not None and self.speculation.wants_hidden
        self.forward_steps = 0
        self._warmed_up = False
        self.warm_up_forwards = 0
        """Extend forwards the warm-up ran (outside the loop's counts)."""

    def _forward(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> Any:
        return self.model(inputs["input_ids"], plans, self.cache, hidden=self.wants_hidden)

    # ---- the loop -------------------------------------------------------------------------

    def _forward_step(self, batch: ForwardBatch, ids: torch.Tensor, result: RunResult) -> Any:
        """One forward through the graph runner (eager for ragged batches), dumped if asked."""
        logits = self._run(self.runner, batch, {"input_ids": ids})
        if self.dump_ring is not None:
            self.dump_ring.maybe_dump(self.forward_steps, self.runner.last_plans, batch)
        self.forward_steps += 1
        result.steps_by_mode[ForwardMode(batch.mode).value] += 1
        return logits

    def _run(
        self, runner: GraphRunner, batch: ForwardBatch, inputs: dict[str, torch.Tensor]
    ) -> Any:
        """One forward through a graph runner, the target's or a draft's: where a rank of
        several adds its checks and its agreed graph size."""
        return runner.step(batch, inputs)

    def _draft_extend(self) -> None:
        """The MTP draft's catch-up on the verify just run (a data-parallel rank runs it
        later, in a forward agreed with its peers)."""
        self.speculation.draft_extend()

    def workload(self) -> list[Request]:
        """The requests this engine serves, in arrival order (a data-parallel rank: its share)."""
        return make_workload(self.config.loop, self.model_config.vocab_size)

    def _more(self, local: bool) -> bool:
        """Whether the loop goes on, given whether this engine has work left (a
        data-parallel rank goes on, idle, while any peer has)."""
        return local

    def _prefill_work(self, running: list[Request]) -> list[tuple[Request, int]]:
        """Prompt chunks for this step: requests in admission order, up to the token budget.

        A request's chunk is never cut short to fill the leftover budget: it waits
        for the next step instead, so a prompt of ``L`` tokens takes exactly
        ``ceil(L / chunk_tokens)`` prefill steps, and admission order is kept.
        """
        chunk = self.config.loop.chunk_tokens
        budget = chunk
        work = []
        for request in running:
            if not request.prefilling:
                continue
            n = min(len(request.prompt) - request.fed, chunk)
            if n > budget:
                break
            work.append((request, n))
            budget -= n
        return work

    def _step_work(self) -> tuple[list[tuple[Request, int]], ForwardMode, list[Request]]:
        """This step's prompt chunks with their mode, and the requests that decode apart from
        them: with ``loop.mixed`` the decoding requests join the chunks as one-token extends
        (one mixed batch, nothing apart), else the chunks are an extend batch."""
        running = self.scheduler.running
        work = self._prefill_work(running)
        prefilling = {id(r) for r, _ in work}
        decoding = [r for r in running if not r.prefilling and id(r) not in prefilling]
        if work and decoding and self.config.loop.mixed:
            return work + [(r, 1) for r in decoding], ForwardMode.MIXED, []
        return work, ForwardMode.EXTEND, decoding

    def _extend_step(
        self, work: list[tuple[Request, int]], mode: ForwardMode, result: RunResult
    ) -> None:
        """Feed each request's chunk; keep the next token of those whose prompt is now done."""
        t0 = time.perf_counter()
        batch, ids = self.scheduler.build_extend(work, mode)
        out = self._forward_step(batch, ids, result)
        best = (out["logits"] if isinstance(out, dict) else out).argmax(dim=-1).tolist()
        firsts = [request.fed for request, _ in work]
        now = time.perf_counter()
        prefilled = 0
        for (request, n), token in zip(work, best):
            was_prefill = request.prefilling
            request.prefill_steps += was_prefill
            request.fed += n
            prefilled += n if was_prefill else 0
            if not request.prefilling:  # the logits predict a kept token
                if request.first_token_at is None:
                    result.ttft_seconds.append(now - request.arrived_at)
                request.take(token, now)
                if not was_prefill:
                    result.decode_tokens += 1
        if self.speculation is not None and isinstance(out, dict):  # the MTP draft's prefill
            self.speculation.prefilled(work, firsts, self.runner.last_plans, out["hidden"])
            now = time.perf_counter()
        result.prefill_tokens += prefilled
        result.prefill_seconds += now - t0
        if mode is ForwardMode.MIXED:
            result.decode_seconds += now - t0
        result.prefill_steps += 1

    def _decode_step(self, requests: list[Request], result: RunResult) -> None:
        """One decode step through the graph runner, or a speculative round."""
        t0 = time.perf_counter()
        if self.speculation is not None:
            target = partial(self._forward_step, result=result)
            result.decode_tokens += self.speculation.verify(requests, target, time.perf_counter)
            self._draft_extend()
        else:
            batch, ids = self.scheduler.build(requests, ForwardMode.DECODE, 1)
            best = self._forward_step(batch, ids, result).argmax(dim=-1).tolist()
            now = time.perf_counter()
            for request, token in zip(requests, best):
                request.take(token, now)
                request.fed += 1
            result.decode_tokens += len(requests)
        now = time.perf_counter()
        result.step_seconds.append(now - t0)
        result.decode_seconds += now - t0
        result.decode_steps += 1

    def step(self, result: RunResult) -> list[Request]:
        """One loop step: prefill chunks and decode, as one mixed batch or two batches.

        Separate (the default): the prompt chunks run as one eager extend batch,
        the decode requests as a decode graph replay. Mixed: decode requests
        join the extend batch as one-token extends, one eager forward instead
        of two. Returns the requests that finished.
        """
        sched = self.scheduler
        work, mode, decoding = self._step_work()
        if work:
            self._extend_step(work, mode, result)
        if decoding:
            self._decode_step(decoding, result)
        if self.speculation is not None:  # the draft's next tokens for everything caught up
            t0 = time.perf_counter()
            self.speculation.finish_step()
            result.decode_seconds += time.perf_counter() - t0
        if not work and not decoding and self.config.loop.idle_steps:
            batch, ids = sched.idle()  # a data-parallel rank with nothing to run still steps
            self._forward_step(batch, ids, result)
        return [r for r in sched.running if r.done]

    def warm_up(self) -> None:
        """Compile what serving would otherwise compile on its first steps, before the clock.

        Decode programs and kernels warm up in graph capture. Extend batches run other
        metadata kernels, the prefill indexer and the attention and MoE kernels at other
        shapes: extends on the null request (``Scheduler.warm_up_batches``: nothing real is
        read or written) run each of them once per compiled variant a first prefill
        meets. The planner's counters start after them.
        """
        if not self._warmed_up:
            self._warmed_up = True
            loop = self.config.loop
            batches = self.scheduler.warm_up_batches(
                self.model_config.index_topk, loop.chunk_tokens, self.limits.max_context
            )
            for batch, ids in batches:
                self._forward({"input_ids": ids}, self.planner.plan(batch))
            self.warm_up_forwards = len(batches)
            self.planner.stats.reset()
        self.runner.capture()

    def run(
        self, *, progress: bool = True, max_steps: int | None = None, keep_tokens: bool = False
    ) -> RunResult:
        """Serve the configured workload to completion (or ``max_steps``); greedy sampling.

        Nothing is kept per finished request unless ``keep_tokens`` asks for its tokens
        (``result.tokens``); counts and bounded timings are kept either way.
        """
        if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 1):
            raise ConfigError("must be >= 1 (or None)", field="max_steps", actual=max_steps)
        loop = self.config.loop
        pending = list(reversed(self.workload()))
        result = RunResult()
        limit = max_steps or loop.max_steps
        bar = tqdm(total=len(pending), unit="req", desc="decode", disable=not progress, leave=False)
        self.warm_up()
        if self.speculation is not None:
            self.speculation.capture()
        start = time.perf_counter()
        step = 0
        sched = self.scheduler
        while self._more(bool(pending or sched.waiting or sched.running)) and step < limit:
            now = time.perf_counter()
            while pending and pending[-1].arrival_step <= step:
                request = pending.pop()
                request.arrived_at = now
                sched.arrive([request])
            sched.admit(self.limits.next_n)
            for request in self.step(result):
                sched.finish(request, step)
                if self.speculation is not None:
                    self.speculation.forget(request)
                result.finished += 1
                result.generated_tokens += len(request.generated)
                if keep_tokens:
                    result.tokens[request.rid] = list(request.generated)
                bar.update(1)
            bar.set_postfix(running=len(sched.running), refresh=False)
            step += 1
        bar.close()
        result.wall_seconds = time.perf_counter() - start
        return result


def _token_sizes(g: GraphsSection) -> list[int] | bool | None:
    """The runner's ragged token buckets: None (extend and mixed batches run eagerly), True
    (the default ladder) or the configured list (``graphs.ragged``, ``graphs.token_sizes``)."""
    if not g.ragged:
        return None
    return g.token_sizes if g.token_sizes is not None else True


def _stages_in_graph(p: PlannerSection) -> bool:
    """Whether the captured graphs pull each replay's staged inputs themselves
    (``planner.staging_in_graph``; ``auto``: whenever the ops run in the graph)."""
    return p.ops_in_graph if p.staging_in_graph == "auto" else bool(p.staging_in_graph)
