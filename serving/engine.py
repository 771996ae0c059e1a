"""The decode engine: model, KV cache, request pool, planner and graph runner, wired once.

Data flows one way: scheduler batch -> planner -> frozen plans -> graph
runner -> model layers. The engine only feeds tokens and reads logits.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from backends.nsa import NSAExtendPlan, NSAPlan
from graphs import GraphRunner
from models.kv_cache import PagedKVCache, RequestPool
from models.model import DSV32Model
from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ConfigError
from planner.limits import Limits
from planner.planner import Planner
from planner.planset import PlanSet
from serving.dump_ring import DumpRing, MismatchDumper
from serving.model_setup import build_model, model_config, resolve_device
from serving.requests import Request, make_workload
from serving.run_config import RunConfig
from serving.samples import Samples
from serving.scheduler import Scheduler


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
    accepted_drafts: int = 0
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
        pages = config.loop.kv_pages or p.max_batch * -(-p.max_context // page) + 1
        self.cache: PagedKVCache = model.new_cache(pages)
        self.pool = RequestPool(p.max_batch + 1, p.max_context, page_size=page, device=self.device)
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
            next_n=p.next_n,
            max_tokens=config.loop.chunk_tokens + p.max_batch,  # a chunk plus decode rows (mixed)
            num_sms=num_sms,
            kv_slots=self.cache.num_slots,
            device=str(self.device),
        )
        self.planner = Planner(
            [NSAPlan, NSAExtendPlan],
            self.limits,
            options={
                "nsa": {"topk": self.model_config.index_topk, "schedule_layout": p.schedule_layout}
            },
            providers=p.providers,
            debug=p.debug or None,
            ops_in_graph=p.ops_in_graph,
            on_mismatch=None if dumps is None else MismatchDumper(dumps.directory / "mismatches"),
        )
        self.planner.check_serves(type(model).PLANS)
        self.dump_ring = (
            None
            if dumps is None
            else DumpRing(dumps.directory, every=dumps.every, keep_last=dumps.keep)
        )
        enabled = config.graphs.enabled
        self.runner = GraphRunner(
            self.planner,
            self._forward,
            req_to_token=self.pool.req_to_token,
            static_inputs={"input_ids": torch.int64},
            sizes=config.graphs.sizes,
            enabled=enabled if isinstance(enabled, bool) else True,
        )
        self.scheduler = Scheduler(self.cache, self.pool, p.max_batch, page)
        self.decode_mode = ForwardMode.TARGET_VERIFY if p.next_n > 1 else ForwardMode.DECODE
        self.forward_steps = 0

    def _forward(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> torch.Tensor:
        return self.model(inputs["input_ids"], plans, self.cache)

    # ---- the loop -------------------------------------------------------------------------

    def _forward_step(self, batch: ForwardBatch, ids: torch.Tensor, result: RunResult) -> Any:
        """One forward through the graph runner (eager for ragged batches), dumped if asked."""
        logits = self.runner.step(batch, {"input_ids": ids})
        if self.dump_ring is not None:
            self.dump_ring.maybe_dump(self.forward_steps, self.runner.last_plans, batch)
        self.forward_steps += 1
        result.steps_by_mode[ForwardMode(batch.mode).value] += 1
        return logits

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

    def _extend_step(
        self, work: list[tuple[Request, int]], mode: ForwardMode, result: RunResult
    ) -> None:
        """Feed each request's chunk; keep the next token of those whose prompt is now done."""
        t0 = time.perf_counter()
        batch, ids = self.scheduler.build_extend(work, mode)
        best = self._forward_step(batch, ids, result).argmax(dim=-1).tolist()
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
        result.prefill_tokens += prefilled
        result.prefill_seconds += now - t0
        if mode is ForwardMode.MIXED:
            result.decode_seconds += now - t0
        result.prefill_steps += 1

    def _decode_step(self, requests: list[Request], result: RunResult) -> None:
        """One decode (or verify) step through the graph runner."""
        t0 = time.perf_counter()
        n = self.limits.next_n if self.decode_mode is ForwardMode.TARGET_VERIFY else 1
        drafts = (
            [r.tokens[r.fed] for r in requests] if n > 1 else None
        )  # trivial draft: repeat the token
        batch, ids = self.scheduler.build(requests, self.decode_mode, n, drafts)
        logits = self._forward_step(batch, ids, result)
        best = logits.argmax(dim=-1).view(len(requests), n).tolist()
        now = time.perf_counter()
        before = sum(len(r.generated) for r in requests)
        for j, (request, row) in enumerate(zip(requests, best)):
            request.take(row[0], now)
            request.fed += 1
            if drafts is not None and not request.done and row[0] == drafts[j]:
                request.take(row[1], now)
                request.fed += 1
                result.accepted_drafts += 1
            del request.generated[request.max_new_tokens :]
        result.decode_tokens += sum(len(r.generated) for r in requests) - before
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
        work = self._prefill_work(sched.running)
        prefilling = {id(r) for r, _ in work}
        decoding = [r for r in sched.running if not r.prefilling and id(r) not in prefilling]
        if work and decoding and self.config.loop.mixed:
            self._extend_step(work + [(r, 1) for r in decoding], ForwardMode.MIXED, result)
        else:
            if work:
                self._extend_step(work, ForwardMode.EXTEND, result)
            if decoding:
                self._decode_step(decoding, result)
        if not work and not decoding and self.config.loop.idle_steps:
            batch, ids = sched.idle()  # a data-parallel rank with nothing to run still steps
            self._forward_step(batch, ids, result)
        return [r for r in sched.running if r.done]

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
        pending = list(reversed(make_workload(loop, self.model_config.vocab_size)))
        result = RunResult()
        limit = max_steps or loop.max_steps
        bar = tqdm(total=len(pending), unit="req", desc="decode", disable=not progress, leave=False)
        self.runner.capture()
        start = time.perf_counter()
        step = 0
        sched = self.scheduler
        while (pending or sched.waiting or sched.running) and step < limit:
            now = time.perf_counter()
            while pending and pending[-1].arrival_step <= step:
                request = pending.pop()
                request.arrived_at = now
                sched.arrive([request])
            sched.admit(self.limits.next_n)
            for request in self.step(result):
                sched.finish(request, step)
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
