"""The planner: every backend's metadata, computed once per batch, in three phases.

- ``plan(batch)``: eager. Fresh tensors, full validation, frozen plans.
- ``capture(bs)``: plans whose tensors are views of static max-size buffers, filled from a
  valid dummy batch; ``record(bs)`` then runs the graph-safe ops inside the caller's CUDA
  graph, once, before the layers.
- ``replay(batch)``: stage raw inputs (one host buffer, one transfer), run host ops, and
  hand back the very plan objects of the capture.

Ragged modes (extend, mixed) are captured per bucket: ``bs`` requests and ``tokens`` query
tokens (``capture(bs, mode, tokens=)``). A bucket holds batches of at most ``bs`` requests,
``tokens`` tokens and ``Limits.kv_token_capacity`` KV tokens in all; its flat KV is
``min(bs * max_context, kv_token_capacity)`` entries long plus the padding requests'.
Padding layout: the real requests' tokens come first, request-major, as unpadded; padding
requests (``bs - real``) hold the per-request pads (``extend_lens`` 0: they add no token;
``seq_lens`` 1 on pool row 0, the null request, whose column 0 is the null slot 0); every
padding token (``tokens - real tokens``) lies past the last request's tokens and holds the
per-token pads (``out_cache_loc`` 0: it writes the null slot). The ops then give
``qo_indptr`` flat at the real token count over the padding requests, ``kv_indptr`` one up
per padding request (whose flat KV entry is the null slot), each padding token its op's
pads (``token_request`` the op's ``pad``, lengths 1, ``kv_ranges`` (0, 1): a read of flat
entry 0, never a write), and each padding request's ``logit_rows`` the last real token's
row. Real rows equal the unpadded eager plan's; ``plan(batch, pad_to=bs,
pad_tokens=tokens)`` is what a replay of the bucket equals bit for bit.

All three go through :func:`materialise` (stage, lay out, run steps); a phase only says
which storage and which steps it uses. Debug mode runs the same replay and then proves its
plans equal a fresh eager plan (:meth:`Planner.verify`). Layers receive a :class:`PlanSet`
and only read it; whatever the number of layers, each op runs once per batch (``stats``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.batch import (
    BATCH,
    BATCH_TABLES,
    HOST_INPUTS,
    RAGGED_MODES,
    ForwardBatch,
    ForwardMode,
    batches_of,
)
from planner.checks import (
    check_bucket,
    check_capture,
    check_pad_to,
    check_replay_size,
    check_size,
    validate_batch,
)
from planner.debug import MismatchHook, check_replay, debug_from_env, guard
from planner.errors import BatchError, ConfigError, ReplayError, SchemaError
from planner.limits import Limits
from planner.ops import ProviderChain, get_op
from planner.plans import PlannerStats, PlanSet, build_plans
from planner.program import (
    Program,
    Step,
    batch_dims,
    build_program,
    check_forced,
    check_options,
    warm_up,
)
from planner.registry import check_serves, schemas_by_mode
from planner.schema import Plan
from planner.staging import Ranges, TransportFactory
from planner.storage import Storage, Storages, Tensors

_DATA_PTR = torch.Tensor.data_ptr
"""Mapped over tensors: cheaper than a comprehension of ``t.data_ptr()`` calls."""
Handles = dict[tuple[str, str], Any]
"""What host ops returned, by the ``(backend, field)`` they produced: plans carry it."""


def materialise(
    storages: Sequence[Storage],
    batches: Sequence[ForwardBatch],
    reqs: int,
    dims: Mapping[str, int],
    ranges: Ranges,
    steps: Sequence[Step] | None,
    *,
    read_device: bool,
    read_table: bool,
    now: bool = True,
) -> list[tuple[Tensors, Handles]]:
    """The one path from a batch to plan tensors, in every phase: stage the inputs, lay out
    the fields, run ``steps`` (None: every step the eager host pass left); per batch, its
    tensors and the handles host ops returned.

    ``storages`` is one fresh storage (eager: one batch), or a static mode's storages (one
    per step of ``batches``, sharing one stager: one transfer moves every step's inputs).
    ``now``: the staged inputs are read before any graph runs (see ``Transport.host``)."""
    first = storages[0]
    if first.static:
        regions = first.stager.stage(
            batches,
            reqs,
            dims["tokens"],
            ranges,
            read_device=read_device,
            read_table=read_table,
            now=now,
        )
        staged = [(s.tensors(r, reqs, dims), frozenset()) for s, r in zip(storages, regions)]
    else:
        staged = [
            first.stage(
                batches[0], reqs, dims, ranges, read_device=read_device, read_table=read_table
            )
        ]
    out = []
    for storage, batch, (tensors, done) in zip(storages, batches, staged):
        if steps is None:
            run, reads = storage.device_steps(done), storage.batch_inputs(done)
        else:
            run, reads = steps, None
        handles = run_steps(run, tensors, batch, static=storage.static, names=reads) if run else {}
        out.append((tensors, handles))
    return out


def run_steps(
    steps: Sequence[Step],
    tensors: Tensors,
    batch: ForwardBatch,
    *,
    static: bool,
    names: Iterable[str] | None = None,
) -> Handles:
    """Run ``steps`` over ``tensors``; the handles host ops returned. ``names``: the batch
    tensors the steps read, where the caller knows (else all)."""
    if steps:  # a replay whose ops are all in the graph runs none here
        bind_batch(tensors, batch, names)
    handles = {}
    for step in steps:
        handle = step.run(tensors, static=static)
        if handle is not None:
            for key in step.outputs:  # a handle field may name any field of the call
                handles[key] = handle
    return handles


def bind_batch(tensors: Tensors, batch: ForwardBatch, names: Iterable[str] | None = None) -> None:
    """The batch's own tensors that ops read in place (the token table, the host lengths):
    ``names`` of them, or all (an implied ``extend_lens_cpu`` is a new tensor per batch)."""
    for name in BATCH_TABLES if names is None else BATCH_TABLES.intersection(names):
        tensors[(BATCH, name)] = getattr(batch, name)
    for name in HOST_INPUTS if names is None else HOST_INPUTS.intersection(names):
        tensors[(BATCH, name)] = batch.host_input(name)


def lengths_max_sum(lengths: torch.Tensor, empty_max: int) -> tuple[int, int]:
    """The longest and the total of a batch's host KV lengths, which size an eager plan;
    ``(empty_max, 1)`` for an empty batch."""
    lens = lengths.numpy()
    if not lens.size:
        return empty_max, 1
    return int(lens.max()), int(lens.sum())


@dataclass
class CapturedStep:
    """The plans of one captured (mode, size), or of one step of a stepped one: the tensors
    a graph reads, where they were, and the batch they were made from."""

    plans: PlanSet
    tensors: Tensors
    handles: Handles
    dummy: ForwardBatch
    named: list[tuple[str, torch.Tensor]]
    """Every plan tensor with its ``backend.field``."""
    pointers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pointers = [t.data_ptr() for _, t in self.named]
        # Each tensor object once (an aliased field is its owner's object): a tensor can only
        # move by being rebound itself (set_, .data =, a storage resize).
        distinct = {id(t): t for _, t in self.named}
        self._watched = list(distinct.values())
        self._watched_at = [t.data_ptr() for t in self._watched]

    def check_unmoved(self, handles: Handles) -> None:
        """The plans a graph reads must still be where capture put them, and host ops must
        have returned the handles they returned at capture: one list comparison in the
        usual case, the field looked for only when something moved."""
        if handles:
            for key, handle in handles.items():
                if handle is not self.handles.get(key):
                    raise ReplayError(
                        "host op returned another handle than at capture", field=".".join(key)
                    )
        if list(map(_DATA_PTR, self._watched)) == self._watched_at:
            return
        for (key, tensor), ptr in zip(self.named, self.pointers):
            if tensor.data_ptr() != ptr:
                raise ReplayError(
                    "plan tensor moved since capture",
                    field=key,
                    expected=hex(ptr),
                    actual=hex(tensor.data_ptr()),
                )


@dataclass
class CapturedBatch:
    """What a capture of one (mode, size) keeps for its replays: the plan set the graph
    reads, each step's tensors, and what every replay of the size needs, resolved once."""

    plans: PlanSet
    steps: list[CapturedStep]
    storages: list[Storage]
    dims: dict[str, int]
    ranges: Ranges
    host_steps: tuple[Step, ...]
    """The steps a replay runs on the host (host ops, and with ``ops_in_graph=False`` all)."""
    table: torch.Tensor
    program_steps: tuple[Step, ...]
    """Every step of the mode's program (what the stats count per replay)."""
    reads_staged: bool
    """A host step reads the staged inputs on the device (a device op run outside the graph,
    or a host op reading a field's values, not only binding its address): a replay's inputs
    must then reach the device before the graph runs."""
    recorded: bool = False
    """``record`` ran since the capture (an emulated graph's capture runs it too)."""

    def check_table(self, table: torch.Tensor) -> None:
        """The graph reads the token table it was captured with: the same memory and shape."""
        mine = self.table
        if table.data_ptr() != mine.data_ptr() or table.shape != mine.shape:
            raise ReplayError(
                "req_to_token is not the table the graph was captured with (moved or reallocated)",
                field="req_to_token",
                expected=(hex(mine.data_ptr()), tuple(mine.shape)),
                actual=(hex(table.data_ptr()), tuple(table.shape)),
            )

    def refresh(self, batches: Sequence[ForwardBatch], bs: int, *, debug: bool) -> None:
        """A replay's work over these captured tensors: stage ``batches`` (the batch, or a
        stepped batch's steps), run the host steps, and check nothing moved. ``debug`` also
        reads device-resident inputs and the token table to check them."""
        results = materialise(
            self.storages,
            batches,
            bs,
            self.dims,
            self.ranges,
            self.host_steps,
            read_device=debug,
            read_table=debug,
            now=self.reads_staged,
        )
        for step, (_, handles) in zip(self.steps, results):
            step.check_unmoved(handles)


class Planner:
    """Plans every backend's metadata for each batch; see the module docstring.

    ``on_mismatch(batch, replayed, eager)`` is called in debug mode before a replay that
    differs from eager is raised (dumps use it to keep both). ``eager_on_host`` lets eager
    plans run ops' host twins (``planner.host_pass``). ``transport`` makes each captured
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
        eager_on_host: bool = True,
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
        self.storages = Storages(
            self._programs, limits, self.device, eager_on_host=eager_on_host, transport=transport
        )
        self.staging = "copy" if transport is None else getattr(transport, "name", "custom")
        """How captured plans' inputs reach the device (the transport's name), for reports."""
        self.storages.check_budget()  # before any static buffer is allocated
        self._captured: dict[tuple[ForwardMode, int | tuple[int, int]], CapturedBatch] = {}
        """By (mode, bucket): the size, or in a ragged mode (size, token bucket)."""
        self._last: CapturedBatch | None = None
        """The capture the last replay staged into (its graph's launch comes next)."""
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
            check_bucket(batch, real, pad_tokens, limits.kv_token_capacity, "pad_tokens")
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
        """One eager plan set (of one step, for a stepped batch) in fresh tensors."""
        program, planned = self.program(mode), mode.plans_as
        # Only sizes so far: staging range-checks the lengths before anything is allocated.
        if pad_to is not None:
            dims = self._static_dims(mode, reqs, pad_tokens)
        else:
            max_len, kv_tokens = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
            tokens = batch.num_tokens if mode.ragged else reqs * program.next_n
            dims = self.dims(mode, reqs, max_len, tokens, kv_tokens)
        ranges = self.storages.ranges(planned, batch.req_to_token)
        storage = self.storages.fresh(planned, reqs)
        # The token table is read on the host for free; on a GPU only in debug mode (a sync).
        table_read = self.debug or not batch.req_to_token.is_cuda
        ((tensors, handles),) = materialise(
            [storage], [batch], reqs, dims, ranges, None, read_device=True, read_table=table_read
        )
        plans = build_plans(program, tensors, handles, dims)
        return PlanSet(plans, "eager", mode, reqs, batch.bs, tokens=pad_tokens)

    def _static_dims(self, mode: ForwardMode, bs: int, tokens: int | None) -> dict[str, int]:
        """The dimensions of a capture of ``bs`` requests (and in a ragged mode ``tokens``)."""
        if tokens is None:
            return self.dims(mode, bs, self.limits.max_context)
        kv_tokens = self.storages.kv_tokens(mode, bs)
        return self.dims(mode, bs, self.limits.max_context, tokens, kv_tokens)

    # ---- capture --------------------------------------------------------------------------

    def dummy_batch(
        self, bs: int, mode: ForwardMode, req_to_token: torch.Tensor, tokens: int | None = None
    ) -> ForwardBatch:
        """What a capture runs its ops on: ``bs`` requests of the shortest legal length, all on
        the null request (row 0 of the token table, slot 0), so nothing real is read or
        written. A draft extend accepts all ``next_n`` tokens of each; a ragged batch of a
        ``tokens`` bucket has ``min(bs, tokens)`` requests of one token (the rest padding)."""
        n = self.tokens_per_request(mode)
        if tokens is not None:
            bs = min(bs, tokens)
        return ForwardBatch(
            seq_lens_cpu=torch.full((bs,), n, dtype=torch.int32),
            req_pool_indices=torch.zeros(bs, dtype=torch.int32),
            req_to_token=req_to_token,
            out_cache_loc=torch.zeros(bs * n, dtype=torch.int32),
            mode=mode,
            next_n=n,
            extend_lens_cpu=(
                torch.full((bs,), n, dtype=torch.int32) if mode.padded_rows or mode.ragged else None
            ),
        )

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
        dummy = self.dummy_batch(bs, mode, req_to_token, tokens)
        self._validate(dummy, device_reads=True)
        program = self.program(mode)
        if tokens is not None:
            _check_ragged_pads(program)
        dims = self._static_dims(mode, bs, tokens)
        batches = batches_of(dummy)
        storages = self.storages.static(mode, len(batches))
        ranges = self.storages.ranges(mode, req_to_token)
        results = materialise(
            storages, batches, bs, dims, ranges, program.steps, read_device=True, read_table=True
        )
        steps, sets = [], []
        for batch, (tensors, handles) in zip(batches, results):
            plans = build_plans(program, tensors, handles, dims)
            plans = PlanSet(plans, "capture", mode, bs, bs, tokens=tokens)
            named = [(f"{b}.{n}", t) for b, p in plans.items() for n, t in p.tensors().items()]
            steps.append(CapturedStep(plans, tensors, handles, batch, named))
            sets.append(plans)
        top = PlanSet.stepped(sets, "capture", mode, bs, bs) if mode.stepped else sets[0]
        on_host = tuple(step for step in program.steps if not step.in_graph)
        reads_staged = any(
            step.chain.current.graph_safe
            or any(who != BATCH and name not in step.spec.binds for who, name in step.input_keys)
            for step in on_host
        )
        self._captured[(mode, bs if tokens is None else (bs, tokens))] = CapturedBatch(
            top, steps, storages, dims, ranges, on_host, req_to_token, program.steps, reads_staged
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
        stager = captured.storages[0].stager
        stager.transport.record(stager.device_buf, first=not captured.recorded)
        captured.recorded = True
        in_graph = [step for step in self.program(mode).steps if step.in_graph]
        for each in captured.steps:  # a stepped mode: every step's ops, in one graph
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

    def replay(
        self, batch: ForwardBatch, bs: int | None = None, *, tokens: int | None = None
    ) -> PlanSet:
        """Refresh the captured plans of size ``bs`` (a ragged batch's: of bucket ``(bs,
        tokens)``) in place for ``batch``; return those same objects. A batch the bucket
        cannot hold (more requests, more tokens, KV past the bound) is refused before any
        buffer is touched.

        Ops recorded in the graph run when the caller replays it; host ops (and, with
        ``ops_in_graph=False``, all ops) run here. Debug mode takes this same path, and also
        reads device-resident inputs and the token table to check them.
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
        captured.refresh(batches, bs, debug=self.debug)
        self._last = captured
        captured.plans.mark("replay", mode, real)
        steps = captured.program_steps * len(batches)  # a tuple times 1 is itself: no copy
        self.stats.count("replay", mode, steps, time.perf_counter() - start, shape)
        return captured.plans

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
        check_bucket(batch, real, tokens, self.limits.kv_token_capacity, "tokens")
        return tokens

    def graph_launched(self) -> None:
        """The last :meth:`replay`'s graph was launched: its transport is told (a graph that
        pulls its inputs itself ties each replay to one launch; a copy needs nothing)."""
        last = self._last
        if last is None:
            if self.storages.transport is None:
                return
            raise ReplayError("graph_launched() before any replay()", field="graph_launched")
        last.storages[0].stager.transport.launched()

    # ---- debug ----------------------------------------------------------------------------

    def verify(self, batch: ForwardBatch, plans: PlanSet) -> None:
        """Debug check after a replay: the replayed plans equal a fresh eager plan, bit for bit.

        Call after the graph has replayed (so graph-recorded ops have run). Also checks that
        padding rows hold the schemas' pad values.
        """
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


def _check_ragged_pads(program: Program) -> None:
    """A captured ragged batch's padding requests add no tokens (the padding layout of the
    module docstring): every staged ``extend_lens`` field pads with 0."""
    for backend, cls in program.schemas.items():
        for name, spec in cls.tensor_specs.items():
            if spec.source == "extend_lens" and program.pads[(backend, name)] != 0:
                raise SchemaError(
                    "a captured ragged batch's padding requests add no tokens: extend_lens "
                    "fields pad with 0",
                    field=f"{backend}.{name}",
                    expected=0,
                    actual=program.pads[(backend, name)],
                )
