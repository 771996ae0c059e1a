"""The decode engine: model, KV cache, request pool, planner and graph runner, wired once.

Data flows one way: scheduler batch -> planner -> frozen plans -> graph
runner -> model layers. The engine only feeds tokens and reads logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from backends.nsa import NSAPlan
from graphs import GraphRunner
from models.kv_cache import PagedKVCache, RequestPool
from models.model import DSV32Model
from planner.batch import ForwardMode
from planner.limits import Limits
from planner.planner import Planner
from planner.planset import PlanSet
from serving.dump_ring import DumpRing, MismatchDumper
from serving.model_setup import build_model, model_config, resolve_device
from serving.requests import Request, make_workload
from serving.run_config import RunConfig
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

    tokens: dict[int, list[int]]
    decode_steps: int = 0
    prefill_steps: int = 0
    wall_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    accepted_drafts: int = 0
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
            num_sms=num_sms,
            kv_slots=self.cache.num_slots,
            device=str(self.device),
        )
        self.planner = Planner(
            [NSAPlan],
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
        self.decode_steps = 0

    def _forward(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> torch.Tensor:
        return self.model(inputs["input_ids"], plans, self.cache)

    # ---- the loop -------------------------------------------------------------------------

    def _prefill_step(self, requests: list[Request]) -> None:
        """Feed one prompt token of each prefilling request, eagerly; predictions are not kept."""
        batch, ids = self.scheduler.build(requests, ForwardMode.DECODE, 1)
        plans = self.planner.plan(batch)
        with self.planner.guard(plans):
            self.model(ids, plans, self.cache)
        for request in requests:
            request.fed += 1

    def _decode_step(self, requests: list[Request]) -> int:
        """One decode (or verify) step through the graph runner; returns drafts accepted."""
        n = self.limits.next_n if self.decode_mode is ForwardMode.TARGET_VERIFY else 1
        drafts = (
            [r.tokens[r.fed] for r in requests] if n > 1 else None
        )  # trivial draft: repeat the token
        batch, ids = self.scheduler.build(requests, self.decode_mode, n, drafts)
        logits = self.runner.step(batch, {"input_ids": ids})
        if self.dump_ring is not None:
            self.dump_ring.maybe_dump(self.decode_steps, self.runner.last_plans, batch)
        self.decode_steps += 1
        best = logits.argmax(dim=-1).view(len(requests), n).tolist()
        accepted = 0
        for j, (request, row) in enumerate(zip(requests, best)):
            request.generated.append(row[0])
            request.fed += 1
            if drafts is not None and not request.done and row[0] == drafts[j]:
                request.generated.append(row[1])
                request.fed += 1
                accepted += 1
            del request.generated[request.max_new_tokens :]
        return accepted

    def run(self, *, progress: bool = True, max_steps: int | None = None) -> RunResult:
        """Serve the configured workload to completion (or ``max_steps``); greedy sampling."""
        loop = self.config.loop
        workload = make_workload(loop, self.model_config.vocab_size)
        pending = list(reversed(workload))
        result = RunResult(tokens={})
        limit = max_steps or loop.max_steps
        bar = tqdm(
            total=len(workload), unit="req", desc="decode", disable=not progress, leave=False
        )
        self.runner.capture()
        start = time.perf_counter()
        step = 0
        sched = self.scheduler
        while (pending or sched.waiting or sched.running) and step < limit:
            while pending and pending[-1].arrival_step <= step:
                sched.arrive([pending.pop()])
            sched.admit(self.limits.next_n)
            prefilling = [r for r in sched.running if r.prefilling]
            if prefilling:
                self._prefill_step(prefilling)
                result.prefill_steps += 1
            decoding = [r for r in sched.running if not r.prefilling and r not in prefilling]
            if decoding:
                t0 = time.perf_counter()
                result.accepted_drafts += self._decode_step(decoding)
                result.step_seconds.append(time.perf_counter() - t0)
                result.decode_steps += 1
                for request in [r for r in decoding if r.done]:
                    sched.finish(request, step)
                    result.tokens[request.rid] = list(request.generated)
                    bar.update(1)
                bar.set_postfix(batch=len(decoding), running=len(sched.running), refresh=False)
            step += 1
        bar.close()
        result.wall_seconds = time.perf_counter() - start
        return result
