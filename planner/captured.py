"""What a capture leaves behind: the plans a graph reads, and how to tell they did not move.

A CUDA graph reads the addresses it was captured with. Replay hands back
these very plan objects; before it does, it checks that every plan tensor
still lives where capture put it and that host ops returned the handles
they returned at capture (always on: a pointer loop, microseconds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from planner.batch import BATCH, BATCH_TABLES, ForwardBatch, ForwardMode
from planner.errors import PlanError, ReplayError
from planner.fallback import ProviderChain
from planner.materialise import Handles, StaticStorage, Tensors, materialise_all, run_steps
from planner.plan_build import build_plans
from planner.planset import PlanSet
from planner.program import Program, Step
from planner.staging import Ranges

_DATA_PTR = torch.Tensor.data_ptr
"""Mapped over tensors: cheaper than a generator of ``t.data_ptr()`` calls."""


@dataclass
class CapturedPlans:
    """The plans of one captured (mode, size), what they point at, and the batch they were made from."""

    plans: PlanSet
    tensors: Tensors
    handles: Handles
    pointers: list[tuple[str, int]]
    plan_tensors: list[torch.Tensor]
    table_ptr: int
    table_shape: tuple[int, ...]
    dummy: ForwardBatch
    addresses: tuple[int, ...] = ()
    _watched: tuple[torch.Tensor, ...] = field(default=(), init=False, repr=False)
    _watched_at: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.addresses = tuple(ptr for _, ptr in self.pointers)
        # Each tensor object once (an aliased field is the same object as its owner): a
        # tensor can only move by being rebound itself (set_, .data =, a storage resize).
        distinct = {id(t): (t, ptr) for t, ptr in zip(self.plan_tensors, self.addresses)}
        self._watched = tuple(t for t, _ in distinct.values())
        self._watched_at = [ptr for _, ptr in distinct.values()]

    def check_unmoved(self, handles: Handles) -> None:
        """The plans a graph reads must still be where capture put them, handles included.

        One list comparison in the usual case (``data_ptr`` mapped over the distinct
        tensors: no generator, no aliased tensor read twice); the field is looked for only
        when something moved.
        """
        for key, handle in handles.items():
            if handle is not self.handles.get(key):
                raise ReplayError(
                    "host op returned another handle than at capture", field=".".join(key)
                )
        if list(map(_DATA_PTR, self._watched)) == self._watched_at:
            return
        for tensor, (key, ptr) in zip(self.plan_tensors, self.pointers):
            if tensor.data_ptr() != ptr:
                raise ReplayError(
                    "plan tensor moved since capture",
                    field=key,
                    expected=hex(ptr),
                    actual=hex(tensor.data_ptr()),
                )


@dataclass(frozen=True)
class HostCall:
    """A host step of a capture, prepared once: what ``Step.run`` works out on every call
    (its key, its parameters with ``static``, its static tensors) resolved at capture, so a
    replay only puts the batch's own tensors in their places and calls the provider chain
    (which still falls back as it does for any call). Static tensors are the capture's and
    cannot move unseen: the replay's pointer check covers every plan tensor.

    A handle may also offer its own replay: ``handle.replay_call(out, template,
    from_batch)`` returns a function of the call's arguments that does what its provider
    does for a replay over these same static tensors, without the provider's look-ups
    (FlashInfer's slots: the wrapper's configuration, its pool), or None. It is used only
    while the step's provider is still the one that made the handle; a failure in it goes
    to the chain, which retries and falls back as for any call. Its second argument, when
    given, is a host array to write the output into instead of ``out``: the output lives
    in the staging buffer's appendix (``planner.staged_outputs``) and the replay lane
    sends it with the inputs."""

    output: tuple[str, str]
    chain: ProviderChain
    key: str
    out: torch.Tensor
    template: tuple
    from_batch: tuple[tuple[int, str], ...]
    params: Mapping
    provider: object = None
    fast: Callable[..., object] | None = None

    @classmethod
    def of(cls, step: Step, tensors: Tensors, handle: object = None) -> HostCall:
        template, from_batch = [], []
        for i, (who, name) in enumerate(step.input_keys):
            if who == BATCH:
                from_batch.append((i, name))
                template.append(None)
            else:
                template.append(tensors[(who, name)])
        graph_safe = step.chain.current.graph_safe  # a fallback keeps it: so does this
        params = step.params if graph_safe else {**step.params, "static": True}
        out, template, from_batch = tensors[step.output], tuple(template), tuple(from_batch)
        make = getattr(handle, "replay_call", None)
        fast = make(out, template, from_batch) if make is not None else None
        return cls(
            step.output,
            step.chain,
            step.key,
            out,
            template,
            from_batch,
            params,
            step.chain.current,
            fast,
        )

    def args_for(self, batch: ForwardBatch) -> list:
        """The call's arguments for ``batch``: the static tensors, the batch's in their places."""
        args = list(self.template)
        for i, name in self.from_batch:
            args[i] = getattr(batch, name) if name in BATCH_TABLES else batch.host_input(name)
        return args

    def run(self, batch: ForwardBatch):
        """The step over ``batch``: what ``Step.run`` returns (a host op's handle, or None)."""
        args = self.args_for(batch)
        fast = self.fast
        if fast is not None and self.chain.current is self.provider:
            try:
                return fast(args)
            except PlanError:
                raise
            except Exception:  # noqa: BLE001  (the chain retries, retires, says so)
                pass
        return self.chain.call(self.key, self.out, args, self.params)


def run_calls(calls: Sequence[HostCall], batch: ForwardBatch, handles: Handles) -> Handles:
    """Run prepared host calls in order over ``batch``; ``handles`` with theirs added."""
    for call in calls:
        handle = call.run(batch)
        if handle is not None:
            handles[call.output] = handle
    return handles


NO_HANDLES = ({},)
"""What a replay with no host ops hands :meth:`CapturedBatch.check_unmoved`: one step,
no handles."""


@dataclass
class CapturedBatch:
    """The captured plans of one (mode, size): the plan set the graph reads and, per step (one
    unless the mode is stepped), what its tensors point at."""

    plans: PlanSet
    steps: list[CapturedPlans]
    # What every replay of this size needs, resolved once at capture (the replay hot path):
    storages: list[StaticStorage] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)
    ranges: Ranges | None = None
    program_steps: tuple[Step, ...] = ()
    host_steps: tuple[Step, ...] = ()
    host_inputs: tuple[str, ...] = ()
    """The batch's own tensors the host ops read (bound per replay: only these)."""
    screened: bool = False
    """One step and a compiled screen: the replay's staging hot path applies (host ops, if
    any, then run over the captured tensors)."""
    host_calls: tuple[HostCall, ...] = ()
    """The host steps of a one-step capture as prepared calls (see :class:`HostCall`)."""
    recorded: bool = False
    """``record`` ran since the capture: its first call is the capture's (an emulated
    graph's capture runs it too, and must pull nothing), the later ones replays."""

    @property
    def table_ptr(self) -> int:
        return self.steps[0].table_ptr

    @property
    def table_shape(self) -> tuple[int, ...]:
        return self.steps[0].table_shape

    def check_table(self, table: torch.Tensor) -> None:
        """The graph reads the token table it was captured with: the same memory and shape."""
        first = self.steps[0]  # torch.Size compares with a tuple as it is
        if table.data_ptr() != first.table_ptr or table.shape != first.table_shape:
            raise ReplayError(
                "req_to_token is not the table the graph was captured with (moved or reallocated)",
                field="req_to_token",
                expected=(hex(self.table_ptr), self.table_shape),
                actual=(hex(table.data_ptr()), tuple(table.shape)),
            )

    def keep(
        self,
        storages: list[StaticStorage],
        dims: dict[str, int],
        ranges: Ranges,
        program_steps: tuple[Step, ...],
    ) -> None:
        """What every replay of this size reads, resolved at capture."""
        self.storages, self.dims, self.ranges = storages, dims, ranges
        self.program_steps = program_steps
        self.host_steps = tuple(step for step in program_steps if not step.in_graph)
        self.host_inputs = tuple(
            sorted(
                {name for step in self.host_steps for who, name in step.input_keys if who == BATCH}
            )
        )
        self.screened = len(storages) == 1 and storages[0].stager.layout.screen is not None
        if len(self.steps) == 1:
            tensors = self.steps[0].tensors
            handles = self.steps[0].handles
            self.host_calls = tuple(
                HostCall.of(step, tensors, handles.get(step.output)) for step in self.host_steps
            )

    def refresh(
        self, batch: ForwardBatch, batches: list[ForwardBatch], bs: int, *, debug: bool
    ) -> None:
        """A replay's staging and host ops off the lane (``batches``: the batch's steps): the
        screen where it applies, else the general path, which debug mode always takes (it
        also reads device-resident inputs and the table); then the plans checked unmoved."""
        if self.screened and not debug and self.stage_screened(batch, bs):
            self.check_unmoved(self.run_host_ops(batch))
            return
        args = (self.storages, batches, bs, self.dims, self.ranges, self.host_steps)
        results = materialise_all(*args, read_device=debug, read_table=debug)
        self.check_unmoved([handles for _, handles in results])

    def stage_screened(self, batch: ForwardBatch, bs: int) -> bool:
        """The replay hot path of a :attr:`screened` capture: the compiled screen stages the
        batch and one copy sends it (``Stager.stage_screened``); False where it cannot, and
        the general path (``materialise_all``) runs instead."""
        stager = self.storages[0].stager
        return stager.stage_screened(batch, bs, self.dims["tokens"], self.ranges) is not None

    def run_host_ops(self, batch: ForwardBatch) -> list[Handles] | tuple[Handles, ...]:
        """After :meth:`stage_screened`: the host ops over the captured tensors (what the
        general path runs after staging), and the handles they returned."""
        if not self.host_steps:
            return NO_HANDLES
        if self.host_calls:
            return [run_calls(self.host_calls, batch, {})]
        tensors = self.steps[0].tensors
        return [run_steps(self.host_steps, tensors, batch, True, inputs=self.host_inputs)]

    def pull_unless_capturing(self, device: torch.device) -> None:
        """``record``'s pull of the staged inputs, where the graph pulls them: launched inside
        a CUDA capture (recorded, not run), run at an emulated graph's replays; not at the
        first record of an emulated graph, which is its capture (the replay that staged
        for it is yet to come)."""
        stager = self.storages[0].stager
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if stager.pull is not None and (self.recorded or capturing):
            stager.pull.pull(stager.device_buf)
        self.recorded = True

    def check_unmoved(self, handles: list[Handles] | tuple[Handles, ...]) -> None:
        for step, step_handles in zip(self.steps, handles):
            step.check_unmoved(step_handles)


def capture_steps(
    program: Program,
    mode: ForwardMode,
    bs: int,
    batches: Sequence[ForwardBatch],
    results: Sequence[tuple[Tensors, Handles]],
    dims: Mapping[str, int],
    table: torch.Tensor,
) -> CapturedBatch:
    """What a capture keeps: each step's plans over its tensors, and their addresses."""
    steps, sets = [], []
    for batch, (tensors, handles) in zip(batches, results):
        plans = PlanSet(build_plans(program, tensors, handles, dims), "capture", mode, bs, bs)
        named = [(f"{b}.{n}", t) for b, p in plans.items() for n, t in p.tensors().items()]
        steps.append(
            CapturedPlans(
                plans,
                tensors,
                handles,
                [(key, t.data_ptr()) for key, t in named],
                [t for _, t in named],
                table.data_ptr(),
                tuple(table.shape),
                batch,
            )
        )
        sets.append(plans)
    top = PlanSet.stepped(sets, "capture", mode, bs, bs) if mode.stepped else sets[0]
    return CapturedBatch(top, steps)


def dummy_batch(
    bs: int, mode: ForwardMode, next_n: int, req_to_token: torch.Tensor
) -> ForwardBatch:
    """What a capture runs its ops on: ``bs`` requests of the shortest legal length, all on the
    null request (row 0 of the token table, slot 0), so nothing real is read or written.
    A draft extend accepts all ``next_n`` tokens of each."""
    return ForwardBatch(
        seq_lens_cpu=torch.full((bs,), next_n, dtype=torch.int32),
        req_pool_indices=torch.zeros(bs, dtype=torch.int32),
        req_to_token=req_to_token,
        out_cache_loc=torch.zeros(bs * next_n, dtype=torch.int32),
        mode=mode,
        next_n=next_n,
        extend_lens_cpu=torch.full((bs,), next_n, dtype=torch.int32) if mode.padded_rows else None,
    )
