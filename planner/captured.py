"""What a capture keeps for its replays.

The plans a graph reads, where they were, the dummy batch they were made from, and how a
replay refreshes them: write and send the raw inputs, run what is not in the graph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.batch import BATCH, BATCH_TABLES, HOST_INPUTS, ForwardBatch, ForwardMode
from planner.checks import check_host_lengths
from planner.device_checks import InputCheck
from planner.errors import ReplayError, SchemaError
from planner.plans import PlanSet
from planner.program import Program, Step
from planner.step_inputs import StepInputs, copy_on_device, write_batch
from planner.storage import StaticStorage, Tensors

Handles = dict[tuple[str, str], Any]
"""What host ops returned, by the ``(backend, field)`` they produced: plans carry it."""


def run_steps(
    steps: Sequence[Step], tensors: Tensors, batch: ForwardBatch, *, static: bool
) -> Handles:
    """Run ``steps`` over ``tensors``; the handles host ops returned."""
    if steps:
        bind_batch(tensors, batch)
    handles = {}
    for step in steps:
        handle = step.run(tensors, static=static)
        if handle is not None:
            for key in step.outputs:  # a handle field may name any field of the call
                handles[key] = handle
    return handles


def dummy_batch(
    bs: int, mode: ForwardMode, table: torch.Tensor, n: int, tokens: int | None = None
) -> ForwardBatch:
    """What a capture runs its ops on: ``bs`` requests of the shortest legal length (``n``
    tokens each, ``n`` of KV), all on the null request (row 0 of the token table, slot 0), so
    nothing real is read or written. A draft extend accepts all ``n`` tokens of each; a ragged
    batch of a ``tokens`` bucket has ``min(bs, tokens)`` requests of one token (the rest
    padding)."""
    if tokens is not None:
        bs = min(bs, tokens)
    return ForwardBatch(
        seq_lens_cpu=torch.full((bs,), n, dtype=torch.int32),
        req_pool_indices=torch.zeros(bs, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.zeros(bs * n, dtype=torch.int32),
        mode=mode,
        next_n=n,
        extend_lens_cpu=(
            torch.full((bs,), n, dtype=torch.int32) if mode.padded_rows or mode.ragged else None
        ),
    )


def bind_batch(tensors: Tensors, batch: ForwardBatch) -> None:
    """The batch's own tensors that ops read in place: the token table, the host lengths."""
    for name in BATCH_TABLES:
        tensors[(BATCH, name)] = getattr(batch, name)
    for name in HOST_INPUTS:
        tensors[(BATCH, name)] = batch.host_input(name)


@dataclass
class CapturedStep:
    """The plans of one captured (mode, size), or of one step of a stepped one: the tensors
    a graph reads, where they were, and the batch they were made from."""

    plans: PlanSet
    tensors: Tensors
    handles: Handles
    dummy: ForwardBatch
    storage: StaticStorage
    named: list[tuple[str, torch.Tensor]]
    """Every plan tensor with its ``backend.field``."""
    tokens: int
    """Token rows (a ragged bucket's tokens, a uniform one's ``reqs * next_n``)."""
    pointers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pointers = [t.data_ptr() for _, t in self.named]

    def check_unmoved(self, handles: Handles) -> None:
        """The plans a graph reads must still be where capture put them, and host ops must
        have returned the handles they returned at capture."""
        for key, handle in handles.items():
            if handle is not self.handles.get(key):
                raise ReplayError(
                    "host op returned another handle than at capture", field=".".join(key)
                )
        for (key, tensor), ptr in zip(self.named, self.pointers):
            if tensor.data_ptr() != ptr:
                raise ReplayError(
                    "plan tensor moved since capture",
                    field=key,
                    expected=hex(ptr),
                    actual=hex(tensor.data_ptr()),
                )

    def check_inputs(self, check: InputCheck, error: torch.Tensor) -> None:
        """The device check of this step's raw inputs, into its source fields."""
        storage, tensors = self.storage, self.tensors
        table = self.dummy.req_to_token
        outputs = storage.outputs(tensors)
        check.run(storage.raw, self.plans.reqs, self.tokens, table, error, outputs)


@dataclass
class CapturedBatch:
    """What a capture of one (mode, size) keeps for its replays: the plan set the graph
    reads, each step's tensors, and what every replay of the size needs, resolved once."""

    plans: PlanSet
    steps: list[CapturedStep]
    check: InputCheck
    error: torch.Tensor
    host_steps: tuple[Step, ...]
    """The steps a replay runs on the host (host ops, and with ``ops_in_graph=False`` all)."""
    table: torch.Tensor
    program_steps: tuple[Step, ...]
    """Every step of the mode's program (what the stats count per replay)."""
    checks_in_graph: bool
    """The device check is recorded in the graph; else (a host step reads the staged
    values, or ops run outside the graph) a replay runs it after the transfer."""
    recorded: bool = False
    """``record`` ran since the capture (an emulated graph's capture runs it too)."""

    host_reads_lengths: bool = field(init=False)
    """A host step reads the batch's host lengths (FlashInfer's ``plan``)."""

    def __post_init__(self) -> None:
        self.host_reads_lengths = any(
            (BATCH, name) in step.input_keys for step in self.host_steps for name in HOST_INPUTS
        )

    @property
    def stager(self):
        return self.steps[0].storage.stager

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

    def inputs(self) -> list[StepInputs]:
        """The host slot's regions the next replay sends (one per step)."""
        return self.stager.inputs()

    def refresh(self, batches: Sequence[ForwardBatch], *, written: bool = False) -> None:
        """A replay's work over these captured tensors: write ``batches`` (the batch, or a
        stepped batch's steps) into the slot (unless ``written``: the engine wrote it there),
        send it, run what is not in the graph, and check nothing moved."""
        stager = self.stager
        pending = {}
        if not written:
            for r, (region, batch) in enumerate(zip(stager.inputs(), batches)):
                left = write_batch(region, batch, batch.out_cache_loc.shape[0])
                if left:
                    pending[r] = dict(left)
        stager.send(now=bool(pending) or not self.checks_in_graph)
        for r, left in pending.items():
            copy_on_device(stager.device_regions[r], stager.layout, left)
        if not self.checks_in_graph:
            for step in self.steps:
                step.check_inputs(self.check, self.error)
        for i, step in enumerate(self.steps):
            handles = {}
            if self.host_steps:
                batch = batches[i]
                if self.host_reads_lengths:
                    check_host_lengths(batch, self.check.bounds.ranges)
                handles = run_steps(self.host_steps, step.tensors, batch, static=True)
            step.check_unmoved(handles)


def check_ragged_pads(program: Program) -> None:
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
