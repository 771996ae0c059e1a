"""The decode engine: model, KV cache, request pool, planner and graph runner, wired once.

Data flows one way: scheduler batch -> planner -> frozen plans -> graph
runner -> model layers. The engine only feeds tokens and reads logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from backends.nsa.extend_plan import NSAExtendPlan
from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.dump_ring import DumpRing, DumpSettings, MismatchDumper
from dsv32_engine.serving.engine_settings import (
    ragged_kv_bound,
    ragged_token_sizes,
    resolve_overlap,
    stages_in_graph,
)
from dsv32_engine.serving.launched import Launched
from dsv32_engine.serving.model_setup import build_model, kv_pages, model_config, resolve_device
from dsv32_engine.serving.plan_setup import kernel_name, plan_schemas
from dsv32_engine.serving.requests import Request, make_workload
from dsv32_engine.serving.run_config import RunConfig
from dsv32_engine.serving.run_result import RunResult
from dsv32_engine.serving.scheduler import Scheduler, slot_for
from dsv32_engine.serving.speculative import Speculation
from graphs import GraphRunner, PulledTransport
from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ConfigError, ReplayError
from planner.limits import Limits
from planner.planner import Planner
from planner.plans import PlanSet

if TYPE_CHECKING:
    from dsv32_engine.serving.busy import GpuBusy


class DecodeEngine:
    """Builds everything from a :class:`RunConfig` and runs the request loop."""

    def __init__(
        self,
        config: RunConfig,
        *,
        model: DSV32Model | None = None,
        dumps: DumpSettings | None = None,
        keep_logits: bool = False,
    ) -> None:
        self.config = config
        self.keep_logits = keep_logits
        """Whether a forward's outputs hold its logits (benchmarks that compare them ask).
        Serving reads the sampled tokens alone; each graph's outputs are memory of its own
        (a logits output is rows x vocab float32: 8.3 MB at 16 rows of DeepSeek-V3.2's
        129,280), while what a forward frees is shared by every graph of the pool."""
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
            max_tokens=config.loop.chunk_tokens,  # the step's budget, decode rows included
            ragged_kv_tokens=ragged_kv_bound(p, self.cache.num_slots),
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
            transport=PulledTransport if stages_in_graph(p) else None,
            on_mismatch=None if dumps is None else MismatchDumper(dumps.directory / "mismatches"),
        )
        self.planner.check_serves(needs)
        self.dump_ring = (
            None
            if dumps is None
            else DumpRing(dumps.directory, every=dumps.every, keep_last=dumps.keep)
        )
        enabled = config.graphs.enabled
        token_sizes = ragged_token_sizes(config)
        # What the loop runs: decode (or verify), and prompt chunks: mixed steps if it mixes
        # (with or without decode rows: one program plans both), else extend steps.
        modes = [ForwardMode.DECODE, *([ForwardMode.TARGET_VERIFY] if spec.next_n > 1 else [])]
        if token_sizes is not None:
            modes.append(ForwardMode.MIXED if config.mixes else ForwardMode.EXTEND)
        self.runner = GraphRunner(
            self.planner,
            self._forward,
            warmup_forward=partial(self._forward, layers=self.model.first_of_each_kind()),
            req_to_token=self.pool.req_to_token,
            static_inputs={"input_ids": torch.int64},
            modes=modes,
            sizes=config.graphs.sizes,
            token_sizes=token_sizes,
            ragged_max_tokens=config.graphs.ragged_max_tokens if token_sizes else None,
            enabled=enabled if isinstance(enabled, bool) else True,
        )
        self.scheduler = Scheduler(self.cache, self.pool, p.max_batch, page, spec.device_drafts)
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
        self.overlap, self.overlap_reason = resolve_overlap(
            config.loop.overlap, self.device, spec.enabled
        )
        self._ahead: list[Launched] = []
        """The forwards the current loop step launched, taken at the next (overlap)."""
        self._last_taken = 0.0
        self._done: list[Request] = []
        """Requests whose last token was taken since the end of the last step."""
        self.forward_steps = 0
        self._warmed_up = False
        self.warm_up_forwards = 0
        """Extend forwards the warm-up ran (outside the loop's counts)."""

    def _forward(
        self, inputs: dict[str, torch.Tensor], plans: PlanSet, layers: list[int] | None = None
    ) -> dict[str, Any]:
        """One step on the device, captured whole in its graph: the ids resolved (a decode
        row's from the token its request sampled last), the model, greedy sampling, and
        where each request gets one logit row (decode, extend, mixed; not verify's ``n``),
        its token kept by pool row for the next step's ids (``serving.token_ids``).
        Outputs: ``tokens`` (the logits' argmax), ``input_ids`` (as resolved: debug mode
        checks them), ``logits`` where kept (``keep_logits``); under an MTP draft, a verify
        step's ``hidden`` (for its draft extend), and a prompt-chunk or mixed step's draft
        catch-up (``Speculation.catch_up``: ``draft_tokens``, ``draft_hidden``).
        A speculating mixed batch's head reads ``n`` rows of every request: its ``tokens``
        are ``[reqs, n]``, read by the host (which fed its verify rows' last tokens).
        A graph's warm-up runs ``layers`` alone (``DSV32Model.first_of_each_kind``)."""
        token_ids = self.scheduler.token_ids
        ids = token_ids.resolve(inputs["input_ids"])
        out = self.model(ids, plans, self.cache, hidden=self.wants_hidden, layers=layers)
        out = dict(out) if isinstance(out, dict) else {"logits": out}
        tokens = out["logits"].argmax(dim=-1)
        plan = plans["nsa"]
        pool_rows = plan.req_pool_indices
        per = plan.logit_rows.shape[1] if isinstance(plan, NSAExtendPlan) else 1
        if per > 1:  # a speculating mixed batch: [reqs, n], by request (graphs slice requests)
            tokens = tokens.view(-1, per)
            out["logits"] = out["logits"].view(tokens.shape[0], per, -1)
        elif tokens.shape[0] == pool_rows.shape[0]:
            token_ids.sampled(pool_rows, tokens)
        if self.wants_hidden and isinstance(plan, NSAExtendPlan):
            # a prompt-chunk or mixed step: the MTP draft catches up here, in the same graph
            out |= self.speculation.catch_up(plans, tokens, out.pop("hidden"))
        if not self.keep_logits:
            del out["logits"]
        return out | {"tokens": tokens, "input_ids": ids}

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

    def _step_work(self) -> tuple[list[tuple[Request, int]], ForwardMode, list[Request]]:
        """This step's work (``Scheduler.step_work``) within the step's token budget
        (``loop.chunk_tokens``), mixing or not (``loop.mixed``), a decoding request's rows
        ``next_n`` (its verify rows when speculating)."""
        return self.scheduler.step_work(
            self.config.loop.chunk_tokens, self.config.mixes, self.limits.next_n
        )

    def _extend_step(
        self, work: list[tuple[Request, int]], mode: ForwardMode, result: RunResult
    ) -> None:
        """Launch each request's chunk; the token after it is kept where the prompt is done."""
        if self.speculation is not None and mode is ForwardMode.MIXED:
            self._mixed_verify_step(work, result)
            return
        t0 = time.perf_counter()
        slot = slot_for(self.planner, mode)
        batch, ids = self.scheduler.build_extend(work, mode, inputs=slot, last_on_device=True)
        checks = self._fed_from_device(work) if self.planner.debug else []
        firsts = [request.fed for request, _ in work]
        if self.speculation is not None:
            self.speculation.stage(work, firsts)
        out = self._forward_step(batch, ids, result)
        rows, prefilled = [], 0
        for request, n in work:
            was_prefill = request.prefilling
            request.prefill_steps += was_prefill
            request.fed += n
            prefilled += n if was_prefill else 0
            kept = not request.prefilling  # the logits predict a kept token
            request.in_flight += kept
            rows.append((request, was_prefill, kept))
        after = None
        if self.speculation is not None and "draft_tokens" in out:  # the MTP draft's catch-up
            after = partial(self.speculation.caught_up, work, [None] * len(work), out, False)
        self._sampled(out, rows, mode, t0, checks, result, prefilled, after)

    def _mixed_verify_step(self, work: list[tuple[Request, int]], result: RunResult) -> None:
        """A speculating mixed step: prompt chunks and verify rows in one forward, read now.

        Each decoding request's ``n`` rows are its last token (the host has read every token
        before it builds the next step) and ``n - 1`` drafts (``Speculation.drafts``: the
        MTP draft's stay on the device). The head reads every request's last ``n`` rows: a
        chunk's row ``n - 1`` is its next token (kept where the prompt is done), a verify
        request's rows are greedy acceptance's (``Speculation.accept``). The MTP draft caught
        up on both kinds of row inside the same forward (``Speculation.catch_up``); its
        draft decode, from each request's last row taken (``Speculation.caught_up``),
        follows at the step's end."""
        spec = self.speculation
        t0 = time.perf_counter()
        drafts = [None if r.prefilling else spec.drafts(r) for r, _ in work]
        firsts = [request.fed for request, _ in work]
        slot = slot_for(self.planner, ForwardMode.MIXED)
        batch, ids = self.scheduler.build_extend(work, ForwardMode.MIXED, slot, drafts=drafts)
        spec.stage(work, firsts, drafts)
        out = self._forward_step(batch, ids, result)
        best = self.runner.read(out["tokens"])  # [requests, n]: waits for the step
        now = time.perf_counter()
        prefilled, verifying, verify_drafts, verify_rows = 0, [], [], []
        for (request, n), row, drafted in zip(work, best, drafts):
            if drafted is not None:
                verifying.append(request)
                verify_drafts.append(drafted)
                verify_rows.append(row)
                continue
            request.prefill_steps += 1
            request.fed += n
            prefilled += n
            if not request.prefilling:  # the prompt is done: row n - 1 is its next token
                result.ttft_seconds.append(now - request.arrived_at)
                request.take(row[-1], now)
        kept, taken = spec.accept(verifying, verify_drafts, verify_rows, now, mixed=True)
        result.decode_tokens += kept
        self._done += [request for request, _ in work if request.done]
        if "draft_tokens" in out:  # the MTP draft caught up on this step's rows in its forward
            verified = iter(taken)
            accepted = [None if drafted is None else next(verified) for drafted in drafts]
            spec.caught_up(work, accepted, out, True)
        seconds = now - max(t0, self._last_taken)
        self._last_taken = now
        result.prefill_tokens += prefilled
        result.prefill_seconds += seconds
        result.decode_seconds += seconds
        result.prefill_steps += 1

    def _decode_step(self, requests: list[Request], result: RunResult) -> None:
        """Launch one decode step through the graph runner, or run a speculative round."""
        if self.speculation is not None:
            t0 = time.perf_counter()
            target = partial(self._forward_step, result=result)
            result.decode_tokens += self.speculation.verify(requests, target, time.perf_counter)
            self._done += [request for request in requests if request.done]
            self._draft_extend()
            now = time.perf_counter()
            result.step_seconds.append(now - t0)
            result.decode_seconds += now - t0
            result.decode_steps += 1
            return
        t0 = time.perf_counter()
        slot = slot_for(self.planner, ForwardMode.DECODE)
        batch, ids = self.scheduler.build(
            requests, ForwardMode.DECODE, 1, inputs=slot, last_on_device=True
        )
        work = [(request, 1) for request in requests]
        checks = self._fed_from_device(work) if self.planner.debug else []
        out = self._forward_step(batch, ids, result)
        for request in requests:
            request.fed += 1
            request.in_flight += 1
        rows = [(request, False, True) for request in requests]
        self._sampled(out, rows, ForwardMode.DECODE, t0, checks, result)

    def _sampled(
        self,
        out: dict[str, Any],
        rows: list[tuple[Request, bool, bool]],
        mode: ForwardMode,
        started: float,
        checks: list[tuple[int, Request, int]],
        result: RunResult,
        prefilled: int = 0,
        after: Callable[[], None] | None = None,
    ) -> None:
        """A forward launched, its tokens sampled and kept on the device for the next step's
        ids (``out``, :meth:`_forward`): their read started, and the forward taken now or a
        loop step later (:class:`Launched`)."""
        launched = Launched(
            self.runner.read_later(out["tokens"]),
            rows,
            mode,
            started,
            self.forward_steps - 1,
            prefilled,
            checks,
            out["input_ids"].clone() if checks else None,  # the graph's, rewritten next replay
            after,
        )
        self._launched(launched, result)

    # ---- taking tokens: at once, or a loop step later ---------------------------------------

    def _launched(self, launched: Launched, result: RunResult) -> None:
        """A forward was launched: its tokens are taken now, or (overlap) once the next loop
        step has launched its own forwards."""
        if self.overlap:
            self._ahead.append(launched)
        else:
            self._take(launched, result)

    def _begin_step(self) -> list[Launched]:
        """The forwards the previous loop step launched, to take at this one's end."""
        previous, self._ahead = self._ahead, []
        return previous

    def _end_step(self, previous: list[Launched], result: RunResult) -> list[Request]:
        """Take the previous step's tokens (this step's forwards are launched by now) and
        release the requests whose last token is launched; the requests whose last token
        was read (finished)."""
        for launched in previous:
            self._take(launched, result)
        sched = self.scheduler
        for request in [r for r in sched.running if r.spent]:
            sched.release(request)
        done, self._done = self._done, []
        return done

    def _runs_eagerly(self, work: list[tuple[Request, int]], mode: ForwardMode) -> bool:
        """Whether this step's prompt chunks (``work`` in ``mode``) run eagerly: no token
        bucket holds them (ragged graphs off, or past the largest bucket or the KV bound)."""
        tokens = sum(n for _, n in work)
        kv = sum(request.fed + n for request, n in work)
        return self.runner.route(mode, len(work), tokens, kv)[0] is None

    def _take_now(self, previous: list[Launched], result: RunResult) -> list[Launched]:
        """Take the previous step's forwards before this step launches an eager one; nothing
        is left to take at the step's end. An eager plan reads its check word (it waits for
        the device) and its forward launches kernel by kernel, a host-bound wait the device
        cannot hide: tokens taken after it (a prompt's first, in a loop of arriving
        requests) would come that much later, and taken before it they cost nothing."""
        for launched in previous:
            self._take(launched, result)
        return []

    def _take(self, launched: Launched, result: RunResult) -> None:
        """A launched forward's sampled tokens, read (waiting for their copy alone), kept."""
        tokens = launched.read.get()
        now = time.perf_counter()
        if launched.fed_from_device:
            self._check_fed(launched)
        for (request, was_prefill, kept), token in zip(launched.rows, tokens):
            if not kept:
                continue
            request.in_flight -= 1
            if request.first_token_at is None:
                result.ttft_seconds.append(now - request.arrived_at)
            request.take(token, now)
            result.decode_tokens += not was_prefill
            if request.done:
                self._done.append(request)
        # From its launch, or from the previous forward's tokens where those came later (a
        # step ahead): the time this forward added, so overlapped forwards are not summed.
        seconds = now - max(launched.started, self._last_taken)
        self._last_taken = now
        if launched.mode is ForwardMode.DECODE:
            result.step_seconds.append(seconds)
            result.decode_seconds += seconds
            result.decode_steps += 1
        else:
            result.prefill_tokens += launched.prefilled
            result.prefill_seconds += seconds
            result.decode_seconds += seconds if launched.mode is ForwardMode.MIXED else 0.0
            result.prefill_steps += 1
        if launched.after is not None:
            launched.after()

    def _fed_from_device(self, work: list[tuple[Request, int]]) -> list[tuple[int, Request, int]]:
        """Debug mode: the rows of ``work`` whose input id the device supplies (the token
        each request sampled last), as (row, request, position)."""
        out, row = [], 0
        for request, n in work:
            for position in range(request.fed, request.fed + n):
                if position >= len(request.prompt):
                    out.append((row, request, position))
                row += 1
        return out

    def _check_fed(self, launched: Launched) -> None:
        """Debug mode's race check of a loop one step ahead: every input id the device
        supplied is the token the host has since read for that position. One read before
        its sampling wrote it (another stream, a missing dependency) names the forward and
        the row."""
        fed = launched.ids.tolist()
        for row, request, position in launched.fed_from_device:
            want = request.tokens[position]
            if fed[row] != want:
                raise ReplayError(
                    f"forward {launched.forward} ({launched.mode.value}) fed row {row} (request "
                    f"{request.rid}, position {position}) a token its request did not sample "
                    "there: the id was read on the device before the sampling that writes it",
                    field="input_ids",
                    expected=want,
                    actual=fed[row],
                )

    def drain(self, result: RunResult) -> list[Request]:
        """Take the tokens still on their way (a loop that ends a step ahead); the requests
        that finished."""
        return self._end_step(self._begin_step(), result)

    def step(self, result: RunResult) -> list[Request]:
        """One loop step: prompt chunks and decodes as one mixed batch (``loop.mixed``) or
        two; one step ahead (``loop.overlap``), its forwards launched before the previous
        step's tokens are taken. Returns the requests that finished."""
        previous = self._begin_step()
        sched = self.scheduler
        work, mode, decoding = self._step_work()
        if previous and work and self._runs_eagerly(work, mode):
            previous = self._take_now(previous, result)
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
        return self._end_step(previous, result)

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

    def _stopping(self, step: int, stop: Callable[[], bool] | None) -> bool:
        """Whether the loop ends before ``step`` on a stop request (a rank of several agrees
        with its peers first)."""
        return stop is not None and stop()

    def run(
        self,
        *,
        progress: bool = True,
        max_steps: int | None = None,
        keep_tokens: bool = False,
        stop: Callable[[], bool] | None = None,
        busy: GpuBusy | None = None,
    ) -> RunResult:
        """Serve the configured workload to completion (or ``max_steps``); greedy sampling.

        Nothing is kept per finished request unless ``keep_tokens`` asks for its tokens
        (``result.tokens``); counts and bounded timings are kept either way. ``stop`` is read
        before every step (Ctrl-C's :class:`~dsv32_engine.serving.cli.StopRequest`): when it
        says so, the loop ends there, between two whole steps, and ``result.interrupted`` says
        the counts are of the steps that ran (a step in flight is taken first). ``busy``
        profiles the GPU over a window of loop steps (``result.gpu_busy``).
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

        def finished(requests: list[Request]) -> None:
            for request in requests:
                sched.finish(request, step)
                if self.speculation is not None:
                    self.speculation.forget(request)
                result.finished += 1
                result.generated_tokens += len(request.generated)
                if keep_tokens:
                    result.tokens[request.rid] = list(request.generated)
                bar.update(1)

        while self._more(bool(pending or sched.waiting or sched.running)) and step < limit:
            if self._stopping(step, stop):
                result.interrupted = True
                break
            if busy is not None:
                busy.at_step(step)
            now = time.perf_counter()
            while pending and pending[-1].arrival_step <= step:
                request = pending.pop()
                request.arrived_at = now
                sched.arrive([request])
            sched.admit(self.limits.next_n)
            finished(self.step(result))
            bar.set_postfix(running=len(sched.running), refresh=False)
            seconds = time.perf_counter() - now
            result.loop_step_seconds.append(seconds)
            if busy is not None:
                busy.loop_step(step, seconds)
            step += 1
        finished(self.drain(result))  # a loop one step ahead ends with a step in flight
        result.wall_seconds = time.perf_counter() - start
        if busy is not None:  # its events are parsed off the clock
            busy.finish(step)
            result.gpu_busy = busy.summary()
        bar.close()
        result.loop_steps = step
        result.generated_tokens += sum(len(r.generated) for r in sched.running)
        result.unfinished = len(pending) + len(sched.waiting) + len(sched.running)
        return result
