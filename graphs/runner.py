"""The graph runner: capture the model step once per batch size, replay it for every batch.

Data flows one way: batch -> ``planner.replay`` (refresh plans in place, host
ops) -> copy model inputs into static buffers -> ``graph.replay()`` (the
planner's graph-safe ops, then the layers) -> outputs sliced to the real rows.

Everything a graph reads stays alive and in place for the runner's life: the
planner's static plans, the runner's input buffers, the captured outputs,
``req_to_token``, the shared pool. Anything the runner cannot replay runs
eagerly, counted by reason and warned about once, never silently. A size
whose capture fails is dropped, reported, and its batches pad to the next
size up; a forward or provider an emulated capture refuses as graph-unsafe
(``GraphSafetyError``) fails the capture outright, as it would fail every size.
"""

from __future__ import annotations

import bisect
import gc
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphs.graph import (
    Graph,
    GraphKind,
    new_graph,
    new_pool,
    no_collection,
    on_capture_stream,
    recover_after_failed_capture,
)
from graphs.inputs import InputSpec, StaticInputs, as_specs
from graphs.outputs import GraphOutputError, output_kinds, slice_outputs
from graphs.plan_writes import refuse_plan_writes
from graphs.sizes import capture_ladder, check_ragged_cap, token_ladder
from graphs.stats import GraphStats
from planner.batch import RAGGED_MODES, ForwardBatch, ForwardMode
from planner.errors import BatchError, ConfigError, GraphSafetyError, PlanWriteError, ReplayError
from planner.planner import Planner
from planner.plans import PlanSet
from planner.step_reads import PendingRead

Forward = Callable[[dict[str, torch.Tensor], PlanSet], Any]
"""``forward(inputs, plans) -> Tensor | dict[str, Tensor]``: one model step over the plans."""
WarmupHook = Callable[[Planner, int], None]
"""``warmup(planner, bs)``: a backend's JIT warm-up (e.g. deep_gemm buckets) before capture."""

GRAPHS_DISABLED = "graphs_disabled"
"""A runner made with ``enabled=False``: every step eager, as its caller asked (counted, never
warned)."""
MODE_NOT_CAPTURED = "mode_not_captured"
BATCH_TOO_LARGE = "batch_too_large"
SIZE_DROPPED = "size_dropped"
RAGGED = "ragged"
"""Extend and mixed batches of a runner without token buckets: eager by design, counted,
never warned."""
TOKENS_OVER_BUCKETS = "tokens_over_buckets"
"""A ragged batch with more query tokens than the largest token bucket."""
TOKENS_PAST_GRAPHS = "tokens_past_graphs"
"""A ragged batch past ``ragged_max_tokens``, the largest token bucket its caller asked for
below its step budget (there steps are GPU-bound and eager costs what a replay does): eager
by design, counted as a ragged step, never warned."""
KV_OVER_BOUND = "kv_tokens_over_bound"
"""A ragged batch whose KV (the sum of its lengths) exceeds the planner's static bound
(``Limits.ragged_kv_tokens``): its flat KV gathers would not fit the captured buffers."""
PEER_EAGER = "peer_eager"
"""Data-parallel attention: a peer rank runs eagerly this step, so every rank does (counted)."""


class GraphWarning(RuntimeWarning):
    """A capture was dropped or a batch ran eagerly (filter on this class)."""


@dataclass
class CapturedGraph:
    """One graph and everything it reads or writes."""

    mode: ForwardMode
    bs: int
    rows: int
    graph: Graph
    plans: PlanSet
    outputs: Any
    kinds: list[str]
    tokens: int | None = None
    """The token bucket of a ragged graph (its ``rows``); None for a uniform one."""

    @property
    def label(self) -> str:
        """``decode/8``, or ``extend/t512`` for a ragged graph's token bucket."""
        return f"{self.mode.value}/{self.bs if self.tokens is None else f't{self.tokens}'}"


class GraphRunner:
    """Captures ``forward`` per (mode, size) and replays it; see the module docstring.

    ``use_cuda_graph``: ``None`` uses real CUDA graphs when the planner's device is
    CUDA and the emulation otherwise; ``False`` forces the emulation (the same
    runner logic without capture, handy for debugging on a GPU); ``True``
    requires CUDA. ``enabled=False`` runs every step eagerly. Ragged modes capture every
    token bucket up to ``Limits.max_tokens`` (the caller's step budget), or up to
    ``ragged_max_tokens`` where the caller caps the ladder below it: past there a step is
    GPU-bound, a graph saves it nothing and costs its capture.
    """

    def __init__(
        self,
        planner: Planner,
        forward: Forward,
        *,
        req_to_token: torch.Tensor,
        static_inputs: Mapping[str, InputSpec | torch.dtype] | None = None,
        modes: Iterable[ForwardMode | str] | None = None,
        sizes: Sequence[int] | None = None,
        token_sizes: Sequence[int] | bool | None = None,
        use_cuda_graph: bool | None = None,
        enabled: bool = True,
        warmup: WarmupHook | None = None,
        warmup_runs: int | None = None,
        warmup_forward: Forward | None = None,
        ragged_max_tokens: int | None = None,
    ) -> None:
        self.planner = planner
        self.forward = forward
        self.warmup_forward = forward if warmup_forward is None else warmup_forward
        """What each graph's warm-up runs (``warmup_runs``) after the first capture's:
        ``forward``, or a cheaper forward that launches every kernel at every shape
        ``forward`` does (a model over one layer of each kind: its layers repeat the same
        kernels and shapes). The first capture's warm-up runs ``forward`` whole, so state a
        layer makes on its first call is made outside any capture. Outputs must have
        ``forward``'s shapes; what it computes is thrown away."""
        self._warmed_whole = False
        self.req_to_token = req_to_token
        self.enabled = enabled
        self.kind: GraphKind = _graph_kind(planner.device, use_cuda_graph)
        limits = planner.limits
        ragged = token_sizes is not None and token_sizes is not False
        self.modes = _modes(planner, modes, ragged)
        self.sizes = capture_ladder(limits.max_batch, sizes)
        self.ragged_reqs = limits.max_batch
        """The request bucket of every ragged graph: per-request buffers are small, so one
        bucket keeps ragged graphs to one per token bucket."""
        check_ragged_cap(ragged_max_tokens, self.ragged_reqs, token_sizes is not True)
        self.ragged_max_tokens = ragged_max_tokens
        """The largest token bucket below the step budget, or None (the budget): ragged
        batches past it run eagerly by design (:data:`TOKENS_PAST_GRAPHS`)."""
        top_tokens = limits.extend_tokens
        if ragged_max_tokens is not None:
            top_tokens = min(top_tokens, ragged_max_tokens)
        self.token_sizes: list[int] = (
            token_ladder(
                top_tokens,
                self.ragged_reqs,
                None if token_sizes is True else token_sizes,  # type: ignore[arg-type]
            )
            if ragged and any(m.ragged for m in self.modes)
            else []
        )
        self.warmup_hook = warmup
        self.warmup_runs = (1 if self.kind == "cuda" else 0) if warmup_runs is None else warmup_runs
        """Eager runs of each graph's forward before its capture: one on CUDA (kernels JIT-
        compile and lazy state is made outside the capture), none for emulated graphs, whose
        capture is itself an eager run. Every size has its own (``warmup_forward``, cheap):
        captured without one, a smaller size's first GEMM of a new shape failed inside the
        capture on an H100 (CUBLAS_STATUS_EXECUTION_FAILED; ``tests/gpu/test_overlap_gpu.py``,
        two engines). That was before captures stopped collecting garbage (``no_collection``),
        which may have been the cause: not re-tested."""
        top = self.sizes[-1] if enabled else 0
        rows = max((top * self._next_n(m) for m in self.modes if not m.ragged), default=top)
        if enabled and self.token_sizes:
            rows = max(rows, self.token_sizes[-1])
            top = max(top, self.ragged_reqs)
        self.inputs = StaticInputs(as_specs(static_inputs), top, rows, planner.device)
        self.stats = GraphStats(kind=self.kind if enabled else "off")
        self._graphs: dict[tuple[ForwardMode, int], CapturedGraph] = {}
        """By (mode, size): the request bucket of a uniform graph, the token bucket of a
        ragged one."""
        self._ladders: dict[ForwardMode, list[int]] = {}
        self._warned: set[str] = set()
        self._captured = False
        self._pool: Any = None
        self.last_plans: PlanSet | None = None
        """The plans the last step ran with (the captured objects after a replay): for dumps."""

    # ---- capture --------------------------------------------------------------------------

    def capture(self) -> GraphStats:
        """Capture every (mode, size), largest first into one shared pool; once.

        ``step`` calls it lazily; an engine calls it at start-up. A size that fails is
        dropped and reported (warning and ``stats.dropped``); on CUDA the runner then
        restores torch's capture state and continues in a fresh pool.
        """
        if self._captured:
            return self.stats
        self._captured = True
        if not self.enabled:
            return self.stats
        start = time.perf_counter()
        gc.collect()  # dead runners' graphs and pools go now, not inside a capture (no_collection)
        cuda = self.kind == "cuda"
        stream = torch.cuda.Stream(self.planner.device) if cuda else None
        self._pool = new_pool(self.kind)
        if cuda:
            self.stats.pool_allocated_bytes = self.stats.pool_reserved_bytes = 0
        # Largest first: later, smaller graphs reuse the blocks the larger ones freed.
        order = sorted(
            ((m, size) for m in self.modes for size in self._ladder_of(m)),
            key=lambda key: (-self._rows(*key), key[0].value),
        )
        broken: Exception | None = None  # torch cannot capture any more: drop the rest
        for mode, bs in order:
            if broken is not None:
                self._drop(mode, bs, broken)
                continue
            failed = False
            try:
                self._graphs[(mode, bs)] = self._capture_one(mode, bs, stream)
            except (GraphOutputError, GraphSafetyError, PlanWriteError):
                raise  # a bug in the forward or a provider, the same at every size: say it
            except Exception as exc:  # any failure drops only this size
                self._drop(mode, bs, exc)
                failed = True
            if failed and cuda:
                try:
                    recover_after_failed_capture(self._pool)  # outside except: the graph is freed
                except Exception as exc:
                    broken = exc
                # Some torch versions also leave the pinned-host allocator "recording" to the
                # failed capture's pool (no Python API ends it) and refuse to begin another
                # capture into that pool id: continue in a fresh pool (costs sharing, only here).
                self._pool = new_pool(self.kind)
        if cuda:
            torch.cuda.synchronize(self.planner.device)
        for mode in self.modes:
            self._ladders[mode] = sorted(size for m, size in self._graphs if m is mode)
            self.stats.captured[mode.value] = list(self._ladders[mode])
        self.stats.planner_static_bytes = self.planner.static_bytes()
        self.stats.input_bytes = self.inputs.nbytes
        self.stats.capture_seconds = time.perf_counter() - start
        return self.stats

    def _capture_one(self, mode: ForwardMode, size: int, stream: Any) -> CapturedGraph:
        """Capture one graph: ``size`` requests of a uniform mode, or ``size`` tokens (of
        :attr:`ragged_reqs` requests) of a ragged one."""
        start = time.perf_counter()
        tokens = size if mode.ragged else None
        bs = self.ragged_reqs if mode.ragged else size
        rows = self._rows(mode, size)
        plans = self.planner.capture(bs, mode, req_to_token=self.req_to_token, tokens=tokens)
        views = self.inputs.views(bs, rows)
        self.inputs.pad(bs, rows)
        planned = time.perf_counter()
        with on_capture_stream(stream):  # the stream the graph is captured on
            self.planner.warm_up()  # providers' JIT work, once, before the first capture
            if self.warmup_hook is not None:
                self.warmup_hook(self.planner, bs)
            warm = self.warmup_forward if self._warmed_whole else self.forward
            for _ in range(self.warmup_runs):
                output_kinds(warm(dict(views), plans), bs, rows)
            self._warmed_whole = self.warmup_runs > 0
        planner, forward = self.planner, self.forward

        kinds: list[str] = []

        def body() -> Any:
            # Binds the very objects the graph reads; nothing is looked up again at replay.
            planner.record(bs, mode, tokens=tokens)
            if kinds:  # an emulated replay: a real one runs no Python, the capture checked it
                return forward(dict(views), plans)
            # At capture only: a layer writing a plan fails (it would write at every
            # replay), and so does a forward that cannot be sliced (shapes).
            with refuse_plan_writes(plans, "the forward at graph capture"):
                out = forward(dict(views), plans)
            kinds.extend(output_kinds(out, bs, rows))
            return out

        graph = new_graph(self.kind, stream)
        before = self._memory()  # synchronises: the warm-up's time ends here
        warmed = time.perf_counter()
        with no_collection():
            outputs = graph.capture(body, pool=self._pool)
        recorded = time.perf_counter()
        after = self._memory()
        entry = CapturedGraph(mode, bs, rows, graph, plans, outputs, kinds, tokens)
        cost: dict[str, float | int | None] = {
            "seconds": time.perf_counter() - start,
            "plan_seconds": planned - start,
            "warmup_seconds": warmed - planned,
            "record_seconds": recorded - warmed,
        }
        if before is not None and after is not None:
            self.stats.pool_allocated_bytes += after[0] - before[0]
            self.stats.pool_reserved_bytes += after[1] - before[1]
            cost["pool_allocated_bytes"] = after[0] - before[0]
        self.stats.capture_costs[entry.label] = cost
        return entry

    def _ladder_of(self, mode: ForwardMode) -> list[int]:
        """What is captured of ``mode``: request buckets, or a ragged mode's token buckets."""
        return self.token_sizes if mode.ragged else self.sizes

    def _rows(self, mode: ForwardMode, size: int) -> int:
        """Per-token rows of the graph of ``size`` in ``mode``."""
        return size if mode.ragged else size * self._next_n(mode)

    def _memory(self) -> tuple[int, int] | None:
        if self.kind != "cuda":
            return None
        device = self.planner.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # torch.cuda.graph empties it too; do it first so deltas are the pool's
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    def _drop(self, mode: ForwardMode, bs: int, exc: BaseException) -> None:
        why = _describe(exc)
        self.stats.dropped.setdefault(mode.value, {})[bs] = why
        warnings.warn(
            f"graph capture of {mode.value} batch size {bs} failed and was dropped ({why}); "
            "its batches pad to the next captured size or run eagerly",
            GraphWarning,
            stacklevel=4,
        )

    # ---- steps ----------------------------------------------------------------------------

    def captured_sizes(self, mode: ForwardMode | str = ForwardMode.DECODE) -> list[int]:
        """Sizes with a working graph for ``mode``, ascending (after capture)."""
        return list(self._ladders.get(ForwardMode(mode), []))

    def route(
        self, mode: ForwardMode, bs: int, tokens: int = 0, kv_tokens: int = 0
    ) -> tuple[int | None, str | None]:
        """(graph size, None) for a batch that replays, or (None, fallback reason).

        A uniform batch of ``bs`` requests replays the smallest request bucket that holds
        it; an idle batch, routed by its shape (``route(batch.plans_as, ...)``), the smallest
        graph of that shape with every row padding (``idle`` alone: decode's). A ragged batch
        of ``tokens`` query tokens and ``kv_tokens`` of KV replays the smallest token
        bucket that holds it, within the planner's static KV bound.
        """
        if mode.ragged and not self.token_sizes:
            return None, RAGGED
        if not self.enabled:
            return None, GRAPHS_DISABLED
        mode = mode.plans_as
        if mode not in self.modes:
            return None, MODE_NOT_CAPTURED
        ladder = self._ladders.get(mode, [])
        if mode.ragged:
            if kv_tokens > self.planner.limits.kv_token_capacity:
                return None, KV_OVER_BOUND
            want, top = max(tokens, 1), self._ladder_of(mode)[-1]
        else:
            want, top = max(bs, 1), self.sizes[-1]
        i = bisect.bisect_left(ladder, want)
        if i < len(ladder):
            return ladder[i], None
        if want <= top:
            return None, SIZE_DROPPED
        if mode.ragged and self.ragged_max_tokens is not None:
            return None, TOKENS_PAST_GRAPHS
        return None, TOKENS_OVER_BUCKETS if mode.ragged else BATCH_TOO_LARGE

    def step(
        self,
        batch: ForwardBatch,
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        at_least: int = 0,
        eager: str | None = None,
    ) -> Any:
        """Run one model step for ``batch``; outputs cover the real rows only.

        ``at_least`` replays a graph of at least that many requests, or of a ragged batch
        that many tokens (data-parallel ranks agree on one size); ``eager`` runs eagerly,
        counted under that reason (a peer rank's batch cannot replay). An idle batch replays
        the graph of its shape (``batch.idle_as``: its peers' verify, draft extend or draft
        decode), or runs eagerly padded with that shape's rows. Graph outputs are views of
        the graph's output memory: valid until the next step, as in every graph runner.
        Copy what must outlive it.
        """
        if not isinstance(batch, ForwardBatch):
            raise BatchError("not a ForwardBatch", field="batch", actual=type(batch).__name__)
        try:
            mode = ForwardMode(batch.mode)
        except ValueError:
            raise BatchError("unknown mode", field="mode", actual=batch.mode) from None
        shape = _shape(batch, mode)
        self.capture()
        inputs = inputs or {}
        if eager:
            size, reason = None, eager
        elif shape.ragged:
            kv_tokens = int(batch.seq_lens_cpu.sum()) if self.token_sizes else 0
            size, reason = self.route(shape, batch.bs, max(batch.num_tokens, at_least), kv_tokens)
        else:
            size, reason = self.route(shape, max(batch.bs, at_least))
        if size is None:
            return self._eager(batch, inputs, reason or GRAPHS_DISABLED)
        return self._replay(batch, inputs, self._graphs[(shape, size)])

    def _replay(
        self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor], entry: CapturedGraph
    ) -> Any:
        reqs, rows = batch.bs, batch.num_tokens
        self.inputs.check(inputs, reqs, rows)
        t0 = time.perf_counter()
        plans = self.planner.replay(batch, entry.bs, tokens=entry.tokens)
        if plans is not entry.plans:
            raise ReplayError(
                "planner replay returned other plans than the graph captured", field="plans"
            )
        self.last_plans = plans
        t1 = time.perf_counter()
        self.inputs.fill_checked(inputs, reqs, rows, entry.bs, entry.rows)  # checked above
        t2 = time.perf_counter()
        entry.graph.replay()
        self.planner.graph_launched()  # a graph that pulls its inputs: the next replay is the next step
        t3 = time.perf_counter()
        if self.planner.debug:
            self.planner.verify(batch, plans)
        t4 = time.perf_counter()
        host = self.stats.host_seconds
        host["refresh"] += t1 - t0
        if entry.tokens is not None:
            self.stats.ragged_refresh_seconds += t1 - t0
        host["inputs"] += t2 - t1
        host["replay"] += t3 - t2
        host["verify"] += t4 - t3
        self.stats.steps += 1
        self.stats.replays[(entry.mode.value, entry.tokens or entry.bs)] += 1
        self.stats.real_rows += rows
        self.stats.padded_rows += entry.rows - rows
        return slice_outputs(entry.outputs, iter(entry.kinds), reqs, rows)

    def read(self, values: torch.Tensor) -> list:
        """``values`` (a step's outputs) on the host, read with the planner's error word in
        one copy (``Planner.read``): a refused batch raises here, none of its outputs read."""
        return self.planner.read(values)

    def read_later(self, values: torch.Tensor) -> PendingRead:
        """:meth:`read` started now and taken later (``Planner.read_later``): a loop that
        runs a step ahead reads step N's outputs after it launched step N+1."""
        return self.planner.read_later(values)

    def _eager(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor], reason: str) -> Any:
        self._warn_fallback(
            batch, reason
        )  # before running: a fallback that then fails is still seen
        start = time.perf_counter()
        plans = self.last_plans = self.planner.plan(batch)
        rows = batch.num_tokens
        self.inputs.check(inputs, batch.bs, rows)
        padded = plans.reqs > batch.bs  # idle: one padding request of its shape, fed padding
        if padded:
            pad_rows = plans.reqs * self._next_n(_shape(batch, ForwardMode(batch.mode)))
            inputs = self.inputs.padding(plans.reqs, pad_rows)
        # Always: torch's count of in-place writes; in debug mode also content digests.
        with self.planner.guard(plans), refuse_plan_writes(plans, "the eager forward"):
            outputs = self.forward(dict(inputs), plans)
        if padded:
            kinds = output_kinds(outputs, plans.reqs, pad_rows)
            outputs = slice_outputs(outputs, iter(kinds), 0, 0)
        self.stats.host_seconds["eager"] += time.perf_counter() - start
        self.stats.steps += 1
        if reason in (RAGGED, TOKENS_PAST_GRAPHS):
            self.stats.ragged[ForwardMode(batch.mode).value] += 1
        else:
            self.stats.eager[reason] += 1
        self.stats.real_rows += rows
        return outputs

    def _warn_fallback(self, batch: ForwardBatch, reason: str) -> None:
        if reason in self._warned or reason in (
            RAGGED,
            TOKENS_PAST_GRAPHS,
            PEER_EAGER,
            GRAPHS_DISABLED,
        ):  # asked for
            return
        self._warned.add(reason)
        mode = ForwardMode(batch.mode)
        shape = _shape(batch, mode)
        sizes = self.captured_sizes(shape) if self.enabled else "none"
        what = mode.value if shape is mode.plans_as else f"{mode.value} (as {shape.value})"
        warnings.warn(
            f"running eagerly ({reason}: {what} batch of {batch.bs}; captured sizes {sizes}); "
            "further fallbacks for this reason are only counted in runner.stats.eager",
            GraphWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        """Release every graph and the pool (the planner's static buffers stay with it)."""
        for entry in self._graphs.values():
            entry.graph.reset()
        self._graphs.clear()
        self._ladders = {mode: [] for mode in self.modes}
        self._pool = None

    def _next_n(self, mode: ForwardMode) -> int:
        """Tokens per request: a graph of ``bs`` requests has ``bs`` times this many rows of
        per-token inputs (a draft extend's, padded; a draft decode's: one per step)."""
        return self.planner.tokens_per_request(mode)


def _shape(batch: ForwardBatch, mode: ForwardMode) -> ForwardMode:
    """The mode whose graph ``batch`` replays (an idle batch's shape); an ``idle_as`` that is
    no mode routes as the batch's own mode, and the planner's door then names the field."""
    try:
        return batch.plans_as
    except ValueError:
        return mode.plans_as


def _describe(exc: BaseException) -> str:
    """The error, and the one it happened while handling: a CUDA capture invalidated by a
    sync raises twice (the sync, then capture_end), and the first is the cause."""
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 4:
        chain.append(chain[-1].__context__)
    parts = [
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        for e in chain
    ]
    return parts[-1] if len(parts) == 1 else f"{parts[-1]} (then {parts[0]})"


def _graph_kind(device: torch.device, use_cuda_graph: bool | None) -> GraphKind:
    if use_cuda_graph is None:
        return "cuda" if device.type == "cuda" else "emulated"
    if use_cuda_graph and device.type != "cuda":
        raise ConfigError(
            "CUDA graphs need a CUDA planner device", field="use_cuda_graph", actual=str(device)
        )
    return "cuda" if use_cuda_graph else "emulated"


def _modes(
    planner: Planner, modes: Iterable[ForwardMode | str] | None, ragged: bool
) -> tuple[ForwardMode, ...]:
    """DECODE, plus TARGET_VERIFY when the planner verifies more than one token, plus the
    ragged modes (extend, mixed) the planner plans when the runner has token buckets.

    Idle batches replay the graphs of their shape (``ForwardBatch.idle_as``).
    """
    if modes is None:
        verify = (ForwardMode.TARGET_VERIFY,) if planner.limits.next_n > 1 else ()
        extra = tuple(m for m in ForwardMode if m in RAGGED_MODES and ragged and m in planner.modes)
        return (ForwardMode.DECODE, *verify, *extra)
    out = []
    for mode in modes:
        try:
            mode = ForwardMode(mode)
        except ValueError:
            raise ConfigError(
                "unknown forward mode",
                field="modes",
                expected=[m.value for m in ForwardMode],
                actual=mode,
            ) from None
        if mode.ragged and not ragged:
            raise ConfigError(
                "extend and mixed batches are captured only with token buckets (token_sizes)",
                field="modes",
                expected=[ForwardMode.DECODE.value, ForwardMode.TARGET_VERIFY.value],
                actual=mode.value,
            )
        out.append(mode.plans_as)
    return tuple(dict.fromkeys(out))
