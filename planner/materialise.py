"""The one path from a batch to plan tensors, shared by the three phases.

Every phase does the same five things: stage the batch's inputs, lay out
the op outputs, run steps, alias fields two backends compute identically,
build the frozen plans. The phases differ only in where the tensors live
(:class:`FreshStorage`: each batch's own tensors; :class:`StaticStorage`:
views of max-size buffers a CUDA graph reads) and in which steps they run
(eager: the host pass's on the host before the staging copy, the rest after;
capture: all; replay: the host ops, the rest are in the graph).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from planner.batch import BATCH, BATCH_TABLES, HOST_INPUTS, ForwardBatch
from planner.dims import resolve_shape
from planner.errors import SchemaError
from planner.fresh import FreshStorage
from planner.fusion import Runnable
from planner.program import Key, Program, Step
from planner.staged_outputs import StagedOutput
from planner.stager import Stager
from planner.staging import Ranges, Segment, StagingLayout

Tensors = dict[Key, torch.Tensor]
Handles = dict[Key, Any]
"""What host ops returned, by the ``(backend, field)`` they produced: plans carry it."""


DERIVED_DIMS = frozenset(
    {"reqs", "rows", "tokens", "kv_tokens", "max_len", "pages", "req_pages", "sms"}
)
"""The dimensions :func:`batch_dims` derives from each batch and the limits: never options."""


def batch_dims(
    program: Program,
    page_size: int,
    num_sms: int,
    *,
    reqs: int,
    max_len: int,
    tokens: int,
    kv_tokens: int,
) -> dict:
    """Values of the symbolic dimensions for ``reqs`` requests of at most ``max_len`` KV tokens,
    ``tokens`` query tokens and ``kv_tokens`` KV tokens in all."""
    dims = dict(program.setting_dims)
    pages = -(-max_len // page_size)
    dims.update(
        reqs=reqs,
        rows=tokens,
        tokens=tokens,
        kernel_reqs=tokens // int(program.settings.get("kernel_next_n", 1)),
        kv_tokens=kv_tokens,
        max_len=max_len,
        pages=pages,
        req_pages=reqs * pages,
        sms=num_sms,
        next_n=program.next_n,
    )
    for backend, cls in program.schemas.items():
        extra = cls.derived_dims(dims, program.backend_settings[backend])
        if not extra.keys().isdisjoint(dims):
            clash = set(extra) & set(dims)
            raise SchemaError(
                "a derived dimension takes a name already in use",
                field=f"{backend}.derived_dims",
                actual=sorted(clash),
            )
        dims.update(extra)
    return dims


def source_segments(program: Program, layout: StagingLayout) -> dict[Key, Segment]:
    """The staging segment each source field of every schema reads."""
    out = {}
    for backend, cls in program.schemas.items():
        for name, spec in cls.tensor_specs.items():
            if spec.source is not None:
                out[(backend, name)] = layout.segments[(spec.source, program.pads[(backend, name)])]
    return out


def _lay_out(
    program: Program,
    segments: Mapping[Key, Segment],
    staged: torch.Tensor,
    outputs: Mapping[Key, torch.Tensor],
    reqs: int,
    tokens: int,
) -> Tensors:
    """Source fields as slices of the staged buffer, op fields as given, aliases as their owner."""
    tensors = {
        key: staged[seg.offset : seg.offset + (tokens if seg.per_token else reqs)]
        for key, seg in segments.items()
    }
    tensors.update(outputs)
    for alias, owner in program.aliases.items():
        tensors[alias] = tensors[owner]
    return tensors


class StaticStorage:
    """Capture and replay: max-size buffers for one mode, and views of them per captured size.

    The views of a size are made once and handed out again on every replay:
    the plans a graph was captured with hold exactly these tensors.
    """

    static = True

    def __init__(
        self,
        program: Program,
        segments: Mapping[Key, Segment],
        stager: Stager,
        max_dims: Mapping[str, int],
        staged: Mapping[Key, StagedOutput] | None = None,
    ) -> None:
        self.program = program
        self.segments = segments
        self.stager = stager
        self.staged = dict(staged or {})
        """Host ops' outputs in the stager's appendix (``planner.staged_outputs``)."""
        self.buffers = {
            step.output: self.staged[step.output].device_view(stager.device_buf, stager.appendix_at)
            if step.output in self.staged
            else torch.zeros(
                resolve_shape(step.spec.shape, max_dims, field=step.key),
                dtype=step.spec.dtype,
                device=stager.device,
            )
            for step in program.steps
        }
        self._views: dict[int, Tensors] = {}

    def prepare(
        self,
        batch: ForwardBatch,
        reqs: int,
        dims: Mapping[str, int],
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool = False,
    ) -> tuple[Tensors, frozenset]:
        """Stage into the static buffers; their views for this size, nothing computed yet."""
        staged = self.stager.stage(
            batch, reqs, dims["tokens"], ranges, read_device=read_device, read_table=read_table
        )
        return self.tensors(staged, reqs, dims), frozenset()

    def batch_inputs(self, done: frozenset) -> None:
        """All the batch's tensors are bound for a capture (it runs every step, once)."""
        return None

    def tensors(self, staged: torch.Tensor, reqs: int, dims: Mapping[str, int]) -> Tensors:
        views = self._views.get(reqs)
        if views is None:
            outputs = {}
            for step in self.program.steps:
                # The leading dimension is the only one that may follow the batch (a
                # batch dimension, or a backend's derived one): slicing it keeps views
                # contiguous, and a static leading dimension slices to the whole.
                rows = resolve_shape(step.spec.shape[:1], dims, field=step.key)[0]
                outputs[step.output] = self.buffers[step.output][:rows]
            views = _lay_out(self.program, self.segments, staged, outputs, reqs, dims["tokens"])
            self._views[reqs] = views
        return views

    @property
    def nbytes(self) -> int:
        """Bytes of the plan buffers (the stager, maybe shared by steps, is counted apart)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


Storage = FreshStorage | StaticStorage


def materialise(
    storage: Storage,
    batch: ForwardBatch,
    reqs: int,
    dims: Mapping[str, int],
    ranges: Ranges,
    steps: Sequence[Step],
    *,
    read_device: bool,
    read_table: bool = False,
) -> tuple[Tensors, Handles]:
    """Stage, lay out, run ``steps``: the batch's tensors, and the handles host ops returned.

    ``read_device`` reads device-resident inputs to stage and check them; ``read_table``
    also checks the token table entries the plans read (``planner.value_checks``)."""
    tensors, done = storage.prepare(
        batch, reqs, dims, ranges, read_device=read_device, read_table=read_table
    )
    inputs = storage.batch_inputs(done)
    if not storage.static and steps is storage.program.steps:
        # eager: the steps the host pass left, fusable pairs as one launch each
        return tensors, run_steps(storage.schedule(done), tensors, batch, False, inputs=inputs)
    return tensors, run_steps(steps, tensors, batch, storage.static, done, inputs)


def materialise_all(
    storages: Sequence[Storage],
    batches: Sequence[ForwardBatch],
    reqs: int,
    dims: Mapping[str, int],
    ranges: Ranges,
    steps: Iterable[Step],
    *,
    read_device: bool,
    read_table: bool = False,
) -> list[tuple[Tensors, Handles]]:
    """:func:`materialise` for the steps of a stepped batch: one storage each, sharing one
    stager, so every step's inputs go to the device in one copy."""
    steps = tuple(steps)
    if len(batches) == 1:
        return [
            materialise(
                storages[0],
                batches[0],
                reqs,
                dims,
                ranges,
                steps,
                read_device=read_device,
                read_table=read_table,
            )
        ]
    stager = storages[0].stager
    staged = stager.stage_all(
        list(batches), reqs, dims["tokens"], ranges, read_device=read_device, read_table=read_table
    )
    out = []
    for storage, batch, region in zip(storages, batches, staged):
        tensors = storage.tensors(region, reqs, dims)
        out.append((tensors, run_steps(steps, tensors, batch, storage.static)))
    return out


def run_steps(
    steps: Sequence[Runnable],
    tensors: Tensors,
    batch: ForwardBatch,
    static: bool,
    done: frozenset = frozenset(),
    inputs: Iterable[str] | None = None,
) -> Handles:
    """Run ``steps`` over ``tensors`` (skipping outputs the host pass made); host ops' handles.
    ``inputs``: the batch tensors the steps read, where the caller knows (else all)."""
    if steps:  # a replay whose ops are all in the graph runs none here
        bind_batch(tensors, batch, inputs)
    handles = {}
    for step in steps:
        if step.output in done:
            continue
        handle = step.run(tensors, static=static)
        if handle is not None:
            handles[step.output] = handle
    return handles


def bind_batch(tensors: Tensors, batch: ForwardBatch, names: Iterable[str] | None = None) -> None:
    """The batch's own tensors that ops read in place (the token table, the host lengths):
    ``names`` of them, or all (an implied ``extend_lens_cpu`` is a new tensor per batch)."""
    for name in BATCH_TABLES if names is None else BATCH_TABLES.intersection(names):
        tensors[(BATCH, name)] = getattr(batch, name)
    for name in HOST_INPUTS if names is None else HOST_INPUTS.intersection(names):
        tensors[(BATCH, name)] = batch.host_input(name)
