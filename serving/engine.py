"""The decode engine: model, KV cache, request pool, planner and graph runner, wired once.

Data flows one way: scheduler batch -> planner -> frozen plans -> graph
runner -> model layers. The engine only feeds tokens and reads logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from tqdm import tqdm

from backends.nsa import warmup_schedule_buckets
from graphs import GraphRunner
from models.config import DSV32Config
from models.kv_cache import PagedKVCache, RequestPool
from models.model import DSV32Model
from planner.batch import ForwardMode
from planner.errors import ConfigError
from planner.limits import Limits
from planner.planner import Planner
from serving.requests import Request, make_workload
from serving.run_config import ModelSection, RunConfig
from serving.scheduler import Scheduler

PAGE = 64
_PRESETS = {
    "tiny": DSV32Config.tiny,
    "small": DSV32Config.small,
    "shapes": DSV32Config.shapes,
    "full": DSV32Config.full,
}


def model_config(section: ModelSection) -> DSV32Config:
    """The model config a run asks for: a preset or a config.json, then overrides."""
    if section.preset in _PRESETS:
        base = _PRESETS[section.preset]()
    elif Path(section.preset).is_file():
        base = DSV32Config.from_hf_config_json(section.preset)
    else:
        raise ConfigError(
            "unknown model preset and no such config.json",
            field="model.preset",
            expected=sorted(_PRESETS),
            actual=section.preset,
        )
    if not section.overrides:
        return base
    unknown = sorted(set(section.overrides) - set(DSV32Config.model_fields))
    if unknown:
        raise ConfigError(
            "unknown model field",
            field=f"model.overrides.{unknown[0]}",
            expected="a DSV32Config field",
        )
    try:
        return DSV32Config.model_validate({**base.model_dump(), **section.overrides})
    except (ValidationError, ConfigError) as exc:
        if isinstance(exc, ConfigError):
            raise ConfigError(str(exc), field=f"model.overrides.{exc.field}") from None
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            first["msg"], field=f"model.overrides.{where}", actual=first.get("input")
        ) from None


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA requested but not available here", field="device", actual=name)
    return device


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

    def __init__(self, config: RunConfig, *, model: DSV32Model | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = model.config if model is not None else model_config(config.model)
        dtype = torch.float32 if config.model.dtype == "float32" else torch.bfloat16
        if config.planner.max_context > self.model_config.max_position_embeddings:
            raise ConfigError(
                "longer than the model's positions",
                field="planner.max_context",
                expected=f"<= {self.model_config.max_position_embeddings} (max_position_embeddings)",
                actual=config.planner.max_context,
            )
        if model is None:
            if config.model.weights and not Path(config.model.weights).is_file():
                raise ConfigError(
                    "no such weights file", field="model.weights", actual=config.model.weights
                )
            if config.model.weights:
                model = DSV32Model.from_file(config.model.weights, device=self.device)
            else:
                model = DSV32Model(
                    self.model_config, seed=config.model.seed, device=self.device, dtype=dtype
                )
        self.model = model
        p = config.planner
        pages = config.loop.kv_pages or p.max_batch * -(-p.max_context // PAGE) + 1
        self.cache: PagedKVCache = model.new_cache(pages)
        self.pool = RequestPool(p.max_batch + 1, p.max_context, page_size=PAGE, device=self.device)
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
            page_size=PAGE,
            next_n=p.next_n,
            num_sms=num_sms,
            kv_slots=self.cache.num_slots,
            device=str(self.device),
        )
        self.planner = Planner(
            ["nsa"],
            self.limits,
            options={
                "nsa": {"topk": self.model_config.index_topk, "schedule_layout": p.schedule_layout}
            },
            providers=p.providers,
            debug=p.debug or None,
            ops_in_graph=p.ops_in_graph,
        )
        enabled = config.graphs.enabled
        self.runner = GraphRunner(
            self.planner,
            self._forward,
            req_to_token=self.pool.req_to_token,
            static_inputs={"input_ids": torch.int64},
            sizes=config.graphs.sizes,
            enabled=enabled if isinstance(enabled, bool) else True,
            warmup=self._warmup,
        )
        self.scheduler = Scheduler(self.cache, self.pool, p.max_batch, PAGE)
        self.decode_mode = ForwardMode.TARGET_VERIFY if p.next_n > 1 else ForwardMode.DECODE
        self._warmed = False
        self.dump_ring = None
        self.decode_steps = 0

    def enable_dumps(self, directory: str | Path, *, every: int = 1, keep: int = 8) -> None:
        """Dump the plans of every ``every``-th decode step (last ``keep``), and any debug mismatch."""
        from serving.dump_ring import DumpRing, install_mismatch_dumps

        self.dump_ring = DumpRing(directory, every=every, keep_last=keep)
        install_mismatch_dumps(self.planner, Path(directory) / "mismatches")

    def _forward(self, inputs: dict[str, torch.Tensor], plans) -> torch.Tensor:
        return self.model(inputs["input_ids"], plans, self.cache)

    def _warmup(self, planner: Planner, bs: int) -> None:
        if not self._warmed:
            self._warmed = True
            warmup_schedule_buckets(
                planner.limits.max_batch,
                planner.limits.next_n,
                planner.limits.num_sms,
                planner.device,
            )

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
