"""The planner: every backend's metadata, computed once per batch, in three phases.

- ``plan(batch)``: eager. Fresh tensors, full validation, frozen plans.
- ``capture(bs)``: plans whose tensors are views of static max-size
  buffers, filled from a valid dummy batch; ``record(bs)`` then runs the
  graph-safe ops inside the caller's CUDA graph, once, before the layers.
- ``replay(batch)``: stage raw inputs (one pinned buffer, one copy), run host
  ops, and hand back the very plan objects of the capture (``staging_in_graph``:
  the graph pulls the pinned buffer itself; ``graph_launched()`` follows its launch).

All three go through :func:`planner.materialise.materialise`; this module
only says which storage and which steps each phase uses, and keeps the
captured plans. Layers receive a :class:`PlanSet` and only read it. Whatever
the number of layers, each op runs once per batch; ``stats`` counts it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from planner.batch import ForwardBatch, ForwardMode
from planner.captured import CapturedBatch, capture_steps, dummy_batch
from planner.debug import MismatchHook, check_replay, debug_from_env, guard
from planner.dims import lengths_max_sum
from planner.door import check_capture, check_pad_to, check_replay_size, check_size, validate_batch
from planner.eager_lane import EagerLanes
from planner.errors import BatchError, ReplayError, SchemaError
from planner.fallback import ProviderChain
from planner.limits import Limits
from planner.materialise import batch_dims, bind_batch, materialise, materialise_all
from planner.ops import get_op
from planner.options import check_forced, check_options, check_staging_in_graph
from planner.plan_build import build_plans
from planner.planset import PlannerStats, PlanSet
from planner.program import Program, build_program, warm_up
from planner.replay_lane import ReplayLane, lane_for
from planner.schema import Plan
from planner.schema_sets import check_serves, schemas_by_mode
from planner.staging_pull import PulledRing
from planner.stepped import batches_of
from planner.storages import Storages


class Planner:
    """Plans every backend's metadata for each batch; see the module docstring.

    ``on_mismatch(batch, replayed, eager)`` is called in debug mode before a
    replay that differs from eager is raised (dumps use it to keep both).
    ``eager_on_host`` lets eager plans run ops' host twins (``planner.host_pass``).
    ``staging_in_graph`` has the captured graphs pull each replay's inputs out of pinned
    memory themselves, so a replay makes no CUDA call (``planner.staging_pull``).
    """

    def __init__(
        self,
        backends: Sequence[str | type[Plan]],
        limits: Limits,
        *,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        providers: Mapping[str, str] | None = None,
        debug: bool | None = None,
        ops_in_graph: bool = True,
        on_mismatch: MismatchHook | None = None,
        eager_on_host: bool = True,
        staging_in_graph: bool = False,
    ) -> None:
        if not backends:
            raise SchemaError("a planner needs at least one backend", field="backends")
        check_staging_in_graph(staging_in_graph, ops_in_graph)
        self.limits = limits
        self.device = limits.torch_device
        self.schemas_by_mode = schemas_by_mode(backends)
        self.schemas = self.schemas_by_mode.get(ForwardMode.DECODE) or next(
            iter(self.schemas_by_mode.values())
        )
        """The uniform-mode plan schema of each backend (what decode and verify layers read)."""
        self.options = check_options(self.schemas_by_mode, options or {})
        self.forced = dict(providers or {})
        self.debug = debug_from_env() if debug is None else debug
        self.ops_in_graph = ops_in_graph
        self.on_mismatch = on_mismatch
        self.stats = PlannerStats()
        base = ("max_batch", "max_context", "page_size", "next_n", "num_sms")
        self._base = {name: getattr(limits, name) for name in base}
        self._chains: dict[tuple[str, str | None], ProviderChain] = {}
        self._programs = {
            mode: self._build_program(mode, schemas)
            for mode, schemas in self.schemas_by_mode.items()
        }
        if ForwardMode.DECODE in self._programs and limits.draft_steps:
            # each draft-decode step is a decode batch: the same program, own buffers per step
            self._programs[ForwardMode.DRAFT_DECODE] = self._programs[ForwardMode.DECODE]
        self._per_request = {
            ForwardMode.TARGET_VERIFY: limits.next_n,
            ForwardMode.DRAFT_EXTEND: limits.next_n,
            ForwardMode.DRAFT_DECODE: limits.draft_steps,
        }
        idle = {ForwardMode.IDLE} if ForwardMode.DECODE in self._programs else set()
        self._modes = frozenset(self._programs) | idle
        self.staging_in_graph = staging_in_graph
        self.storages = Storages(
            self._programs,
            limits,
            self.device,
            eager_on_host=eager_on_host,
            staging_in_graph=staging_in_graph,
        )
        self._pulled: PulledRing | None = None
        """The ring the last replay staged into, where the graphs pull (its launch next)."""
        self.storages.check_budget()  # before any static buffer is allocated
        self._captured: dict[tuple[ForwardMode, int], CapturedBatch] = {}
        self._lanes: dict[tuple[ForwardMode, int], ReplayLane] = {}
        self._eager_lanes = EagerLanes(
            self._programs, self.storages, limits, self._per_request, self.device
        )
        self._warmed = False
        check_forced(self._programs.values(), self.forced)

    # ---- building -------------------------------------------------------------------------

    def _chain(self, op_name: str, forced: str | None) -> ProviderChain:
        key = (op_name, forced)
        if key not in self._chains:
            self._chains[key] = ProviderChain(get_op(op_name), self.device, forced)
        return self._chains[key]

    def _build_program(self, mode: ForwardMode, schemas: Mapping[str, type[Plan]]) -> Program:
        args = (self._base, self.options, self.forced, self._chain, mode, self.ops_in_graph)
        return build_program(schemas, *args)

    def program(self, mode: ForwardMode) -> Program:
        """The ordered steps for ``mode`` (built once, at construction); idle plans as decode,
        each step of a draft decode too."""
        mode = (mode if type(mode) is ForwardMode else ForwardMode(mode)).plans_as  # 1 us less
        program = self._programs.get(mode)
        if program is None:
            draft = mode is ForwardMode.DRAFT_DECODE and ForwardMode.DECODE in self._programs
            raise BatchError(
                "draft decode is planned with Limits.draft_steps >= 1"
                if draft
                else "no backend of this planner plans this mode",
                field="draft_steps" if draft else "mode",
                expected=">= 1" if draft else sorted(m.value for m in self._programs),
                actual=0 if draft else mode.value,
            )
        return program

    def tokens_per_request(self, mode: ForwardMode) -> int:
        """Query tokens each request of a ``mode`` batch adds (a draft decode's: its steps)."""
        return self._per_request.get(ForwardMode(mode), 1)

    @property
    def modes(self) -> frozenset[ForwardMode]:
        """The modes this planner plans (idle whenever decode is)."""
        return self._modes

    def check_serves(
        self, needs: Mapping[str, type[Plan] | tuple[type[Plan], ...]], *, who: str = "the model"
    ) -> None:
        """Refuse a consumer whose layers read plans this planner does not make (at engine
        build, so layers read typed fields with no per-step guard); see ``schema_sets``."""
        check_serves(self.schemas_by_mode, needs, who)

    def warm_up(self) -> None:
        """Run every chosen provider's warm-up hook once, before any graph is captured.

        Marked done before the hooks run: a failing warm-up is reported once (the
        caller drops what it was capturing), not retried for every size.
        """
        if not self._warmed:
            self._warmed = True
            warm_up(self._programs.values(), self.limits, self.device)

    def providers_chosen(self, mode: ForwardMode = ForwardMode.DECODE) -> dict[str, str]:
        """``backend.field`` -> provider name, for reports."""
        return {s.key: s.provider.name for s in self.program(mode).steps}

    def dims(
        self,
        mode: ForwardMode,
        reqs: int,
        max_len: int,
        tokens: int | None = None,
        kv_tokens: int | None = None,
    ) -> dict[str, int]:
        """Values of the symbolic dimensions for a batch of ``reqs`` requests.

        ``tokens`` defaults to the uniform ``reqs * next_n`` and ``kv_tokens``
        to ``reqs * max_len`` (what static buffers hold).
        """
        program = self.program(mode)
        return batch_dims(
            program,
            self.limits.page_size,
            self.limits.num_sms,
            reqs=reqs,
            max_len=max_len,
            tokens=reqs * program.next_n if tokens is None else tokens,
            kv_tokens=reqs * max_len if kv_tokens is None else kv_tokens,
        )

    def static_bytes(self) -> int:
        """Bytes held in static buffers (plans and staging) for every captured mode."""
        return self.storages.nbytes()

    def _validate(self, batch: ForwardBatch, *, device_reads: bool) -> ForwardMode:
        if isinstance(batch, ForwardBatch) and batch.mode is ForwardMode.DRAFT_DECODE:
            self.program(batch.mode)  # unplanned (no draft_steps): say so before next_n does
        mode = validate_batch(
            batch,
            device=self.device,
            max_batch=self.limits.max_batch,
            max_tokens=self.limits.extend_tokens,
            next_n=self._per_request,
            device_reads=device_reads,
        )
        if mode not in self.modes:
            self.program(mode)  # raises, naming the modes this planner plans
        return mode

    # ---- eager ----------------------------------------------------------------------------

    def plan(self, batch: ForwardBatch, *, pad_to: int | None = None) -> PlanSet:
        """Eager plans in tensors of their own (``planner.fresh_pool`` recycles unread memory).

        ``pad_to`` plans the batch padded to that many requests at the static
        shapes a captured plan has: what a replay of that size must equal. An
        idle batch is planned as one padding request, so kernels never see an
        empty batch (deep_gemm cannot compile one).
        """
        return self._plan(batch, pad_to=pad_to, count=True)

    def _plan(self, batch: ForwardBatch, *, pad_to: int | None, count: bool) -> PlanSet:
        start = time.perf_counter()
        # a uniform host batch: the door's checks in one pass (``planner.eager_lane``)
        plans = None if pad_to is not None or self.debug else self._eager_lanes.plan(batch)
        if plans is not None:
            mode, times = plans.mode, 1
        else:
            mode = self._validate(batch, device_reads=True)
            pad_to = check_pad_to(pad_to, batch.bs, self.limits.max_batch, mode)
            reqs = pad_to or max(batch.bs, 1)
            sets = [self._plan_one(one, mode, reqs, pad_to) for one in batches_of(batch)]
            plans = (
                PlanSet.stepped(sets, "eager", mode, reqs, batch.bs) if mode.stepped else sets[0]
            )
            times = len(sets)
        if count:
            steps = self.program(mode).steps
            self.stats.count_eager(mode, steps, times, time.perf_counter() - start)
        return plans

    def _plan_one(
        self, batch: ForwardBatch, mode: ForwardMode, reqs: int, pad_to: int | None
    ) -> PlanSet:
        """One eager plan set (of one step, for a stepped batch) in fresh tensors."""
        program, planned = self.program(mode), mode.plans_as
        # Only sizes so far: staging range-checks the lengths before anything is allocated.
        if pad_to is not None:
            dims = self.dims(mode, reqs, self.limits.max_context)
        else:
            max_len, kv_tokens = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
            tokens = batch.num_tokens if mode.ragged else reqs * program.next_n
            dims = self.dims(mode, reqs, max_len, tokens, kv_tokens)
        ranges = self.storages.ranges(planned, batch.req_to_token)
        storage = self.storages.fresh(planned, reqs)
        # The token table is read on the host for free; on a GPU only in debug mode (a sync).
        table_read = self.debug or not batch.req_to_token.is_cuda
        args = (storage, batch, reqs, dims, ranges, program.steps)
        tensors, handles = materialise(*args, read_device=True, read_table=table_read)
        return PlanSet(build_plans(program, tensors, handles, dims), "eager", mode, reqs, batch.bs)

    # ---- capture --------------------------------------------------------------------------

    def dummy_batch(self, bs: int, mode: ForwardMode, req_to_token: torch.Tensor) -> ForwardBatch:
        """A valid batch of ``bs`` requests at the shortest legal length, all on the null request."""
        return dummy_batch(bs, mode, self.tokens_per_request(mode), req_to_token)

    def capture(
        self, bs: int, mode: ForwardMode = ForwardMode.DECODE, *, req_to_token: torch.Tensor
    ) -> PlanSet:
        """Plans over static buffers for batches padded to ``bs``, filled from a dummy batch.

        Every op runs once here (warming up JIT kernels before the graph is
        captured). Call :meth:`record` inside the graph capture, before the layers.
        """
        mode = ForwardMode(mode)
        bs = check_capture(mode, bs, self.limits.max_batch)
        dummy = self.dummy_batch(bs, mode, req_to_token)
        self._validate(dummy, device_reads=True)
        program = self.program(mode)
        dims = self.dims(mode, bs, self.limits.max_context)
        batches = batches_of(dummy)
        storages = self.storages.static(mode, len(batches))
        ranges = self.storages.ranges(mode, req_to_token)
        results = materialise_all(
            storages, batches, bs, dims, ranges, program.steps, read_device=True, read_table=True
        )
        captured = capture_steps(program, mode, bs, batches, results, dims, req_to_token)
        captured.keep(storages, dims, ranges, program.steps)
        self._captured[(mode, bs)] = captured
        n = self.tokens_per_request(mode)
        if lane := ReplayLane.for_capture(captured, mode, n, self.device):
            self._lanes[(mode, bs)] = lane
        self.stats.batches["capture"] += 1
        return captured.plans

    def captured_batch_sizes(self, mode: ForwardMode = ForwardMode.DECODE) -> list[int]:
        """Sizes :meth:`capture` has made plans for in ``mode``, ascending."""
        return sorted(bs for m, bs in self._captured if m is ForwardMode(mode))

    def record(self, bs: int, mode: ForwardMode = ForwardMode.DECODE) -> None:
        """Run the graph-safe ops on the static views; call inside graph capture, before the layers."""
        mode = ForwardMode(mode).plans_as  # an idle batch's graph is decode's
        captured = self._captured_for(
            mode, check_size("bs", bs, 1, self.limits.max_batch, "size out of range")
        )
        captured.pull_unless_capturing(self.device)  # first: the ops below read what it pulls
        in_graph = [step for step in self.program(mode).steps if step.in_graph]
        for each in captured.steps:  # a stepped mode: every step's ops, in one graph
            bind_batch(each.tensors, each.dummy)
            for step in in_graph:
                step.run(each.tensors, static=True)

    def _captured_for(self, mode: ForwardMode, bs: int) -> CapturedBatch:
        captured = self._captured.get((mode, bs))
        if captured is None:
            raise ReplayError(
                f"no capture for mode {mode.value} at this size",
                field="bs",
                expected=self.captured_batch_sizes(mode),
                actual=bs,
            )
        return captured

    # ---- replay ---------------------------------------------------------------------------

    def replay(self, batch: ForwardBatch, bs: int | None = None) -> PlanSet:
        """Refresh the captured plans of size ``bs`` in place for ``batch``; return those same objects.

        Ops recorded in the graph run when the caller replays it; host ops
        (and, with ``ops_in_graph=False``, all ops) run here.
        """
        start = time.perf_counter()
        lane = lane_for(self._lanes, batch, bs)
        if lane is not None and not self.debug and lane.run(batch):
            self._pulled = lane.stager.pull
            self.stats.count_replay(lane.mode, lane.steps, time.perf_counter() - start)
            return lane.plans
        mode = self._validate(batch, device_reads=self.debug)
        real = batch.bs
        bs = check_replay_size(bs, real, self.limits.max_batch)
        captured = self._captured_for(mode.plans_as, bs)
        captured.check_table(batch.req_to_token)
        batches = batches_of(batch) if mode.stepped else [batch]
        captured.refresh(batch, batches, bs, debug=self.debug)
        self._pulled = captured.storages[0].stager.pull
        captured.plans.mark("replay", mode, real)
        self.stats.record_steps(mode, captured.program_steps, len(batches))
        self.stats.batches["replay"] += 1
        self.stats.host_seconds["replay"] += time.perf_counter() - start
        return captured.plans

    def graph_launched(self) -> None:
        """The last :meth:`replay`'s graph was launched (``staging_in_graph``: call it after
        each such launch; else it does nothing). A launch declared twice is refused."""
        if not self.staging_in_graph:
            return
        if self._pulled is None:
            raise ReplayError("graph_launched() before any replay()", field="graph_launched")
        self._pulled.launched()

    # ---- debug ----------------------------------------------------------------------------

    def verify(self, batch: ForwardBatch, plans: PlanSet) -> None:
        """Debug check after a replay: the replayed plans equal a fresh eager plan, bit for bit.

        Call after the graph has replayed (so graph-recorded ops have run).
        Also checks that padding rows hold the schemas' pad values.
        """
        eager = self._plan(batch, pad_to=plans.reqs, count=False)
        program = self.program(plans.mode)
        self.stats.verified += 1
        real = self.real_rows(plans.mode, batch)
        check_replay(batch, plans, eager, program.pads, real, self.on_mismatch)

    def real_rows(self, mode: ForwardMode, batch: ForwardBatch) -> dict[str, int]:
        """:meth:`Program.real_rows` of ``mode``'s program."""
        return self.program(mode).real_rows(batch)

    @contextmanager
    def guard(self, plans: Mapping[str, Plan]) -> Iterator[None]:
        """Debug mode: digest plans before and after the forward; a layer that wrote raises."""
        with guard(plans, self.debug):
            yield
