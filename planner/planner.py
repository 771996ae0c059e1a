"""The planner: every backend's metadata, computed once per batch, in three phases.

- ``plan(batch)``: eager. Fresh tensors; the batch's values checked on the device and any
  refusal raised at once; frozen plans.
- ``capture(bs)``: plans whose tensors are views of static max-size buffers, made from a
  valid dummy batch; ``record(bs)`` then records, inside the caller's CUDA graph and before
  the layers, the device check of the step's raw inputs and every graph-safe op.
- ``replay(batch)``: the step's raw inputs written once into the mode's staging slot (by the
  engine, :meth:`Planner.step_inputs`, or from the batch), sent in one transfer, host ops
  run, and the very plan objects of the capture handed back. The graph checks the values;
  :meth:`Planner.read` raises a refusal with the step's outputs.

Ragged modes (extend, mixed) are captured per bucket: ``bs`` requests and ``tokens`` query
tokens (``capture(bs, mode, tokens=)``), holding at most ``Limits.kv_token_capacity`` KV
tokens in all. Padding layout: the real requests' tokens come first, request-major;
padding requests hold the per-request pads (``extend_lens`` 0, ``seq_lens`` 1 on the null
request 0, whose column 0 is the null slot 0); padding tokens lie past the last real one
and hold the per-token pads (``out_cache_loc`` 0: the null slot). The ops then give
``qo_indptr`` flat over the padding requests, ``kv_indptr`` one up per padding request,
each padding token its op's pads (a read of flat entry 0, never a write), and each padding
request's ``logit_rows`` the last real token's row. Real rows equal the unpadded eager
plan's; ``plan(batch, pad_to=bs, pad_tokens=tokens)`` is what a replay of the bucket
equals bit for bit, which debug mode proves after every replay (:meth:`Planner.verify`).
Layers receive a :class:`PlanSet` and only read it; each op runs once per batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from planner.batch import RAGGED_MODES, ForwardBatch, ForwardMode, batches_of
from planner.captured import (
    CapturedBatch,
    CapturedStep,
    check_ragged_pads,
    dummy_batch,
    run_steps,
)
from planner.checks import (
    check_bucket,
    check_capture,
    check_pad_to,
    check_replay_size,
    check_size,
    lengths_max_sum,
    validate_batch,
    validate_written,
)
from planner.debug import MismatchHook, check_replay, debug_from_env, guard
from planner.device_checks import ERROR_WORDS, InputCheck, refusal
from planner.errors import BatchError, ConfigError, ReplayError, SchemaError
from planner.limits import Limits
from planner.ops import ProviderChain, get_op
from planner.plans import PlannerStats, PlanSet, build_plans
from planner.program import Program, batch_dims, build_program, warm_up
from planner.registry import check_serves, schemas_by_mode
from planner.schema import Plan
from planner.settings import check_forced, check_options
from planner.staging import TransportFactory
from planner.step_inputs import StepInputs, write_batch
from planner.step_reads import PendingRead
from planner.storage import Storages


class Planner:
    """Plans every backend's metadata for each batch; see the module docstring.

    ``on_mismatch(batch, replayed, eager)`` is called in debug mode before a replay that
    differs from eager is raised (dumps use it to keep both). ``transport`` makes each captured
    mode's :class:`~planner.staging.Transport` (default: the one copy; a graph runner may
    have its graphs pull the staged inputs themselves, ``graphs.PulledTransport``).
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
        transport: TransportFactory | None = None,
    ) -> None:
        if not backends:
            raise SchemaError("a planner needs at least one backend", field="backends")
        if getattr(transport, "in_graph", False) and not ops_in_graph:
            raise ConfigError(
                "a transport that stages inside the graph needs ops_in_graph: ops run "
                "outside the graph would read the staged inputs before the graph moved them",
                field="transport",
                expected="ops_in_graph=True",
                actual="ops_in_graph=False",
            )
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
        self.storages = Storages(self._programs, limits, self.device, transport=transport)
        self.staging = "copy" if transport is None else getattr(transport, "name", "custom")
        """How captured plans' inputs reach the device (the transport's name), for reports."""
        self.storages.check_budget()  # before any static buffer is allocated
        self._captured: dict[tuple[ForwardMode, int | tuple[int, int]], CapturedBatch] = {}
        """By (mode, bucket): the size, or in a ragged mode (size, token bucket)."""
        self._last: CapturedBatch | None = None
        """The capture the last replay staged into (its graph's launch comes next)."""
        self._warmed = False
        self._errors: torch.Tensor | None = None
        self._reads = 0  # reads started (read_later): each one's number, for errors
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
        """The ordered steps for ``mode`` (built once, at construction); idle plans as decode
        (a batch of another shape: ``program(batch.plans_as)``), each draft-decode step too."""
        mode = ForwardMode(mode).plans_as
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
        build, so layers read typed fields with no per-step guard)."""
        check_serves(self.schemas_by_mode, needs, who)

    def warm_up(self) -> None:
        """Run every chosen provider's warm-up hook once, before any graph is captured.

        Marked done before the hooks run: a failing warm-up is reported once (the caller
        drops what it was capturing), not retried for every size.
        """
        if not self._warmed:
            self._warmed = True
            warm_up(self._programs.values(), self.limits, self.device)

    def providers_chosen(self, mode: ForwardMode = ForwardMode.DECODE) -> dict[str, str]:
        """``backend.field`` -> provider name, for reports."""
        return {key: s.provider.name for s in self.program(mode).steps for key in s.keys}

    def dims(
        self,
        mode: ForwardMode,
        reqs: int,
        max_len: int,
        tokens: int | None = None,
        kv_tokens: int | None = None,
    ) -> dict[str, int]:
        """Values of the symbolic dimensions for a batch of ``reqs`` requests.

        ``tokens`` defaults to the uniform ``reqs * next_n`` and ``kv_tokens`` to
        ``reqs * max_len`` (what static buffers hold).
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

    def _validate(
        self, batch: ForwardBatch, *, device_reads: bool
    ) -> tuple[ForwardMode, ForwardMode, int]:
        """The batch checked at the door: its mode, the mode that plans it (an idle batch's
        shape, ``ForwardBatch.plans_as``) and its query tokens."""
        if isinstance(batch, ForwardBatch) and batch.inputs is not None:
            _, tokens = validate_written(batch, self._per_request)
            return batch.inputs.mode, batch.inputs.mode, tokens
        if isinstance(batch, ForwardBatch) and batch.mode is ForwardMode.DRAFT_DECODE:
            self.program(batch.mode)  # unplanned (no draft_steps): say so before next_n does
        mode, shape, tokens = validate_batch(
            batch,
            device=self.device,
            max_batch=self.limits.max_batch,
            max_tokens=self.limits.extend_tokens,
            next_n=self._per_request,
            planned=self._programs,
            device_reads=device_reads,
        )
        if mode not in self._modes:
            self.program(mode)  # raises, naming the modes this planner plans
        return mode, shape, tokens

    # ---- eager ----------------------------------------------------------------------------

    def plan(
        self, batch: ForwardBatch, *, pad_to: int | None = None, pad_tokens: int | None = None
    ) -> PlanSet:
        """Eager plans in tensors of their own.

        ``pad_to`` plans the batch padded to that many requests (a ragged batch also to
        ``pad_tokens`` query tokens) at the static shapes a captured plan has: what a replay
        of that bucket must equal. An idle batch is planned by its shape's program as one
        padding request, so kernels never see an empty batch (deep_gemm cannot compile one);
        its plans are idle, and stepped when its shape is.
        """
        return self._plan(batch, pad_to=pad_to, pad_tokens=pad_tokens, count=True)

    def _plan(
        self, batch: ForwardBatch, *, pad_to: int | None, pad_tokens: int | None, count: bool
    ) -> PlanSet:
        start = time.perf_counter()
        mode, shape, real = self._validate(batch, device_reads=True)
        limits = self.limits
        pad_to, pad_tokens = check_pad_to(
            pad_to, pad_tokens, batch.bs, limits.max_batch, limits.extend_tokens, mode
        )
        if pad_tokens is not None:
            check_bucket(real, pad_tokens, "pad_tokens")
        reqs = pad_to or max(batch.bs, 1)
        sets = [self._plan_one(one, shape, reqs, pad_to, pad_tokens) for one in batches_of(batch)]
        plans = PlanSet.stepped(sets, "eager", mode, reqs, batch.bs) if shape.stepped else sets[0]
        plans.mode = mode  # an idle batch's plans are idle, whatever shape planned them
        if count:
            steps = self.program(shape).steps
            self.stats.count("eager", mode, steps * len(sets), time.perf_counter() - start, shape)
        return plans

    def _plan_one(
        self,
        batch: ForwardBatch,
        mode: ForwardMode,
        reqs: int,
        pad_to: int | None,
        pad_tokens: int | None = None,
    ) -> PlanSet:
        """One eager plan set (of one step, for a stepped batch) in fresh tensors: the raw
        inputs written and sent, checked on the device (the refusal read at once: an eager
        plan waits for its check), then every op."""
        program = self.program(mode)
        if pad_to is not None:
            dims = self._static_dims(mode, reqs, pad_tokens)
        else:
            max_len, kv_tokens = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
            tokens = batch.num_tokens if mode.ragged else reqs * program.next_n
            dims = self.dims(mode, reqs, max_len, tokens, kv_tokens)
        storage = self.storages.fresh(mode)
        real_tokens = batch.out_cache_loc.shape[0]
        tensors, region, error = storage.stage(batch, real_tokens, dims)
        check = self.storages.check(mode, batch.req_to_token, static=pad_tokens is not None)
        outputs = storage.outputs(tensors)
        check.run(region, reqs, dims["tokens"], batch.req_to_token, error, outputs)
        self._raise_for(error.tolist(), check)
        handles = run_steps(program.steps, tensors, batch, static=False)
        plans = build_plans(program, tensors, handles, dims)
        return PlanSet(plans, "eager", mode, reqs, batch.bs, tokens=pad_tokens)

    def _static_dims(self, mode: ForwardMode, bs: int, tokens: int | None) -> dict[str, int]:
        """The dimensions of a capture of ``bs`` requests (and in a ragged mode ``tokens``)."""
        if tokens is None:
            return self.dims(mode, bs, self.limits.max_context)
        kv_tokens = self.storages.kv_tokens(mode, bs)
        return self.dims(mode, bs, self.limits.max_context, tokens, kv_tokens)

    # ---- capture --------------------------------------------------------------------------

    def capture(
        self,
        bs: int,
        mode: ForwardMode = ForwardMode.DECODE,
        *,
        req_to_token: torch.Tensor,
        tokens: int | None = None,
    ) -> PlanSet:
        """Plans over static buffers for batches padded to ``bs``, filled from a dummy batch;
        a ragged mode's also to ``tokens`` query tokens (its token bucket, in ``[1,
        Limits.extend_tokens]``; see the module docstring for the padding layout).

        Every op runs once here (warming up JIT kernels before the graph is captured). Call
        :meth:`record` inside the graph capture, before the layers.
        """
        mode = ForwardMode(mode)
        limits = self.limits
        bs, tokens = check_capture(mode, bs, tokens, limits.max_batch, limits.extend_tokens)
        dummy = dummy_batch(bs, mode, req_to_token, self.tokens_per_request(mode), tokens)
        self._validate(dummy, device_reads=True)
        program = self.program(mode)
        if tokens is not None:
            check_ragged_pads(program)
        dims = self._static_dims(mode, bs, tokens)
        batches = batches_of(dummy)
        storages = self.storages.static(mode, len(batches))
        stager = storages[0].stager
        check = self.storages.check(mode, req_to_token, static=True)
        for region, batch in zip(stager.inputs(), batches):
            write_batch(region, batch, batch.out_cache_loc.shape[0])
        stager.send(now=True)
        steps, sets = [], []
        for batch, storage in zip(batches, storages):
            tensors = storage.tensors(bs, dims)
            outputs = storage.outputs(tensors)
            check.run(storage.raw, bs, dims["tokens"], req_to_token, self.errors, outputs)
            self._raise_for(self.errors.tolist(), check)  # a dummy batch: never refused
            handles = run_steps(program.steps, tensors, batch, static=True)
            plans = build_plans(program, tensors, handles, dims)
            plans = PlanSet(plans, "capture", mode, bs, bs, tokens=tokens)
            named = [(f"{b}.{n}", t) for b, p in plans.items() for n, t in p.tensors().items()]
            steps.append(
                CapturedStep(plans, tensors, handles, batch, storage, named, dims["tokens"])
            )
            sets.append(plans)
        top = PlanSet.stepped(sets, "capture", mode, bs, bs) if mode.stepped else sets[0]
        on_host = tuple(step for step in program.steps if not step.in_graph)
        # the device check belongs in the graph unless something outside it reads its fields
        reads_staged = any(
            step.chain.current.graph_safe
            or any(
                key in storages[0].sources.values() and key[1] not in step.spec.binds
                for key in step.input_keys
            )
            for step in on_host
        )
        self._captured[(mode, bs if tokens is None else (bs, tokens))] = CapturedBatch(
            top,
            steps,
            check,
            self.errors,
            on_host,
            req_to_token,
            program.steps,
            checks_in_graph=not reads_staged,
        )
        self.stats.batches["capture"] += 1
        return top

    def captured_batch_sizes(self, mode: ForwardMode = ForwardMode.DECODE) -> list[int]:
        """Sizes :meth:`capture` has made plans for in ``mode``, ascending (a ragged mode's
        request buckets, each once: :meth:`captured_buckets` has their token buckets)."""
        return sorted({bs for bs, _ in self.captured_buckets(mode)})

    def captured_buckets(self, mode: ForwardMode = ForwardMode.DECODE) -> list[tuple[int, int]]:
        """``(bs, tokens)`` of every capture in ``mode``, ascending: a ragged mode's token
        buckets, a uniform mode's ``bs`` times its tokens per request."""
        mode, per = ForwardMode(mode), self.tokens_per_request(mode)
        return sorted(
            bucket if isinstance(bucket, tuple) else (bucket, bucket * per)
            for m, bucket in self._captured
            if m is mode
        )

    def record(
        self, bs: int, mode: ForwardMode = ForwardMode.DECODE, *, tokens: int | None = None
    ) -> None:
        """Run the graph-safe ops on the static views; call inside graph capture, before the
        layers. First what the transport records (a graph that pulls its inputs itself). An
        idle batch's graph is its shape's (``batch.plans_as``; ``idle`` here: decode's)."""
        mode = ForwardMode(mode).plans_as
        captured = self._captured_for(
            mode, check_size("bs", bs, 1, self.limits.max_batch, "size out of range"), tokens
        )
        stager = captured.stager
        stager.transport.record(stager.device_buf, first=not captured.recorded)
        captured.recorded = True
        in_graph = [step for step in self.program(mode).steps if step.in_graph]
        for each in captured.steps:  # a stepped mode: every step's check and ops, in one graph
            if captured.checks_in_graph:
                each.check_inputs(captured.check, captured.error)
            run_steps(in_graph, each.tensors, each.dummy, static=True)

    def _captured_for(self, mode: ForwardMode, bs: int, tokens: int | None) -> CapturedBatch:
        captured = self._captured.get((mode, bs if tokens is None else (bs, tokens)))
        if captured is None:
            ragged = tokens is not None and bs in self.captured_batch_sizes(mode)
            raise ReplayError(
                f"no capture for mode {mode.value} at this {'token bucket' if ragged else 'size'}",
                field="tokens" if ragged else "bs",
                expected=self.captured_buckets(mode)
                if mode.ragged
                else self.captured_batch_sizes(mode),
                actual=(bs, tokens) if mode.ragged else bs,
            )
        return captured

    # ---- replay ---------------------------------------------------------------------------

    @property
    def errors(self) -> torch.Tensor:
        """The error word of captured plans' device checks (int32 on the planner's device):
        the first refusal since it was last read (:meth:`read`), written inside the graphs.
        Made with the first capture's buffers."""
        if self._errors is None:
            self._errors = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=self.device)
        return self._errors

    def stages(self, mode: ForwardMode) -> bool:
        """Whether ``mode`` has a staging slot (it was captured): :meth:`step_inputs` takes it."""
        return self.storages.captured(ForwardMode(mode)) is not None

    def step_inputs(self, mode: ForwardMode = ForwardMode.DECODE) -> StepInputs:
        """Where the engine writes the next step of ``mode`` (captured first): typed views of
        the staging slot the next :meth:`replay` of that mode sends. Write rows ``[0, n)`` of
        each input, call ``set_counts``, and hand :meth:`StepInputs.batch` to :meth:`replay`
        (or to the graph runner): nothing is copied again. The slot stays the same until a
        replay of the mode sends it."""
        mode = ForwardMode(mode)
        storages = self.storages.captured(mode)
        if storages is None or mode.stepped:
            raise ReplayError(
                "step inputs are handed out for captured modes with one batch per step",
                field="mode",
                expected=sorted(m.value for m in self.storages.captured_modes() if not m.stepped),
                actual=mode.value,
            )
        return storages[0].stager.inputs()[0]

    def replay(
        self, batch: ForwardBatch, bs: int | None = None, *, tokens: int | None = None
    ) -> PlanSet:
        """Refresh the captured plans of size ``bs`` (a ragged batch's: of bucket ``(bs,
        tokens)``) in place for ``batch``; return those same objects.

        The batch is written into the mode's staging slot (unless it is that slot's own,
        :meth:`step_inputs`) and sent; its values are checked on the device, inside the
        graph, and a refusal is raised when the step's outputs are read (:meth:`raise_for`).
        What the host knows without reading values is refused here, before any buffer is
        touched: the structure at the door, a batch larger than the bucket.

        Ops recorded in the graph run when the caller replays it; host ops (and, with
        ``ops_in_graph=False``, all ops) run here. Debug mode takes this same path.
        """
        start = time.perf_counter()
        mode, shape, real_tokens = self._validate(batch, device_reads=self.debug)
        real = batch.bs
        bs = check_replay_size(bs, real, self.limits.max_batch)
        if tokens is not None or mode in RAGGED_MODES:
            tokens = self._replay_tokens(batch, real_tokens, mode, tokens)
        captured = self._captured_for(shape, bs, tokens)  # an idle batch's: its shape's
        captured.check_table(batch.req_to_token)
        batches = batches_of(batch) if shape.stepped else [batch]
        # the engine wrote the step into this slot itself: it is sent as it is
        written = batch.inputs is not None and batch.inputs is captured.inputs()[0]
        captured.refresh(batches, written=written)
        self._last = captured
        captured.plans.mark("replay", mode, real)
        runs = len(captured.steps)
        self.stats.count(
            "replay", mode, captured.program_steps * runs, time.perf_counter() - start, shape
        )
        return captured.plans

    def raise_for(self, word: Sequence[int]) -> None:
        """Raise the refusal an error word read from the device holds (:attr:`errors`, read
        with a step's outputs), naming the field, the row and the value; nothing for a
        clean word. The device word is cleared once read as set."""
        if word[0]:
            self.errors.zero_()
            self._raise_for(word, self.storages.check_by_id(int(word[6])))

    def read_later(self, values: torch.Tensor) -> PendingRead:
        """Start the read of ``values`` (a step's outputs, e.g. its sampled tokens) with
        :attr:`errors`, in one asynchronous device-to-host copy behind the step, and return
        at once: :meth:`PendingRead.get` waits for that copy alone and raises a refusal of
        the device check, naming the field, the row and the value (``planner.step_reads``).
        An engine that runs a step ahead gets step N's after it launched step N+1."""
        read = PendingRead(values, self.errors, self.raise_for, self._reads)
        self._reads += 1
        return read

    def read(self, values: torch.Tensor) -> list:
        """``values`` on the host, as ``values.tolist()`` gives them: :meth:`read_later`,
        then its ``get``, which raises a refusal before it returns any of them."""
        return self.read_later(values).get()

    def read_errors(self) -> None:
        """Read :attr:`errors` now (a synchronisation) and raise what it holds."""
        self.raise_for(self.errors.tolist())

    @staticmethod
    def _raise_for(word: Sequence[int], check: InputCheck) -> None:
        error = refusal(word, check.bounds)
        if error is not None:
            raise error

    def _replay_tokens(
        self, batch: ForwardBatch, real: int, mode: ForwardMode, tokens: object
    ) -> int:
        """The token bucket of a ragged replay, checked to hold ``batch`` (``real`` query
        tokens); a uniform one has none."""
        if not mode.ragged:
            raise BatchError(
                f"a {mode.value} replay's tokens follow from bs: leave tokens out",
                field="tokens",
                expected=None,
                actual=tokens,
            )
        if tokens is None:
            raise BatchError(
                f"a {mode.value} replay names its token bucket",
                field="tokens",
                expected=self.captured_buckets(mode),
                actual=None,
            )
        tokens = check_size("tokens", tokens, 1, self.limits.extend_tokens, "out of range")
        check_bucket(real, tokens, "tokens")
        return tokens

    def graph_launched(self) -> None:
        """The last :meth:`replay`'s graph was launched: its transport is told (a graph that
        pulls its inputs itself ties each replay to one launch; a copy needs nothing)."""
        last = self._last
        if last is None:
            if self.storages.transport is None:
                return
            raise ReplayError("graph_launched() before any replay()", field="graph_launched")
        last.stager.transport.launched()

    # ---- debug ----------------------------------------------------------------------------

    def verify(self, batch: ForwardBatch, plans: PlanSet) -> None:
        """Debug check after a replay: the replayed plans equal a fresh eager plan, bit for bit.

        Call after the graph has replayed (so graph-recorded ops have run). Also checks that
        padding rows hold the schemas' pad values.
        """
        self.read_errors()  # the replay's own device check first
        eager = self._plan(batch, pad_to=plans.reqs, pad_tokens=plans.tokens, count=False)
        program = self.program(batch.plans_as)  # an idle batch's: its shape's
        self.stats.verified += 1
        real = program.real_rows(batch)
        check_replay(batch, plans, eager, program.pads, real, self.on_mismatch)

    def real_rows(self, mode: ForwardMode, batch: ForwardBatch) -> dict[str, int]:
        """:meth:`Program.real_rows` of ``mode``'s program."""
        return self.program(mode).real_rows(batch)

    @contextmanager
    def guard(self, plans: Mapping[str, Plan]) -> Iterator[None]:
        """Debug mode: digests around a forward, for writes ``graphs.plan_writes`` cannot see."""
        with guard(plans, self.debug, self.stats):
            yield
