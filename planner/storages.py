"""The buffers a planner keeps per mode and size, made on first use and reused.

Staging layouts, the fresh storage of eager plans (per request count), the
static storage of captured plans (per mode), and the value ranges of staged
inputs (per token table). Kept out of the planner so its phases read as
what they do, not as cache management.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from planner.batch import ForwardMode
from planner.dims import resolve_shape
from planner.errors import ConfigError
from planner.fresh import FreshStorage
from planner.host_pass import Switch, host_pass_for
from planner.limits import Limits
from planner.materialise import StaticStorage, batch_dims, source_segments
from planner.program import Program
from planner.staged_outputs import appendix_words, staged_outputs
from planner.stager import RING, Stager
from planner.staging import Ranges, StagingLayout, input_ranges
from planner.staging_pull import SLOTS


class Storages:
    """One planner's staging layouts, storages and input ranges."""

    def __init__(
        self,
        programs: Mapping[ForwardMode, Program],
        limits: Limits,
        device: torch.device,
        *,
        eager_on_host: bool = True,
        staging_in_graph: bool = False,
    ) -> None:
        self.programs = programs
        self.staging_in_graph = staging_in_graph
        self.limits = limits
        self.device = device
        self.eager_on_host = eager_on_host
        self._switch = Switch()
        self._retired_fusions: set[tuple[str, str]] = set()
        """Fused launches that failed in any mode or size (``planner.fusion``): off for all."""
        self._layouts: dict[tuple[ForwardMode, int], StagingLayout] = {}
        self._fresh: dict[tuple[ForwardMode, int], FreshStorage] = {}
        self._static: dict[ForwardMode, list[StaticStorage]] = {}
        self._ranges: dict[tuple, Ranges] = {}

    def token_capacity(self, mode: ForwardMode, reqs: int) -> int:
        """Query tokens a batch of ``reqs`` requests may hold in ``mode``: the staging capacity."""
        if mode.ragged:
            return self.limits.extend_tokens
        return reqs * self.programs[mode].next_n

    def layout(self, mode: ForwardMode, reqs: int) -> StagingLayout:
        """Sized by request count, not by tokens: a ragged batch's layout holds the token
        capacity, so layouts stay few however the extend lengths vary."""
        key = (mode, reqs)
        layout = self._layouts.get(key)
        if layout is None:
            program = self.programs[mode]
            sources = [
                (spec.source, program.pads[(backend, name)])
                for backend, cls in program.schemas.items()
                for name, spec in cls.tensor_specs.items()
                if spec.source is not None
            ]
            layout = StagingLayout(sources, reqs, self.token_capacity(mode, reqs))
            self._layouts[key] = layout
        return layout

    def ranges(self, mode: ForwardMode, table: torch.Tensor) -> Ranges:
        key = (mode, table.shape[0], table.shape[1])
        ranges = self._ranges.get(key)
        if ranges is None:
            limits = self.limits
            ranges = self._ranges[key] = input_ranges(
                limits.max_context,
                self.programs[mode].next_n,
                limits.kv_slots,
                table,
                ragged=mode.ragged,
                partial=mode.padded_rows,
            )
        return ranges

    def fresh(self, mode: ForwardMode, reqs: int) -> FreshStorage:
        key = (mode, reqs)
        storage = self._fresh.get(key)
        if storage is None:
            program, layout = self.programs[mode], self.layout(mode, reqs)
            segments = source_segments(program, layout)
            stager = Stager(layout, self.device, static=False)
            host_pass = (
                host_pass_for(program, segments, self._switch) if self.eager_on_host else None
            )
            storage = self._fresh[key] = FreshStorage(
                program, segments, stager, host_pass, self._retired_fusions
            )
        return storage

    def static(self, mode: ForwardMode, steps: int = 1) -> list[StaticStorage]:
        """Capture and replay buffers of ``mode``: one storage per step (a stepped mode's
        ``steps``), all staged through one stager, so one copy moves every step's inputs."""
        storages = self._static.get(mode)
        if storages is None:
            limits, program = self.limits, self.programs[mode]
            layout = self.layout(mode, limits.max_batch)
            segments = source_segments(program, layout)
            # host ops' small outputs ride the staging copy (one step: one region)
            staged = staged_outputs(program) if steps == 1 else {}
            stager = Stager(
                layout,
                self.device,
                static=True,
                regions=steps,
                appendix=appendix_words(staged),
                pulled=mode.value if self.staging_in_graph else None,
            )
            max_dims = self.max_dims(mode)
            storages = self._static[mode] = [
                StaticStorage(program, segments, stager, max_dims, staged) for _ in range(steps)
            ]
        return storages

    def max_dims(self, mode: ForwardMode) -> dict[str, int]:
        """The dimensions static buffers are sized for: the largest batch's, and for a
        backend's derived dimensions the largest value over every batch size (a split
        count shrinks as the batch grows)."""
        limits, program = self.limits, self.programs[mode]
        sizes = [
            batch_dims(
                program,
                limits.page_size,
                limits.num_sms,
                reqs=reqs,
                max_len=limits.max_context,
                tokens=self.token_capacity(mode, reqs),
                kv_tokens=reqs * limits.max_context,
            )
            for reqs in range(1, limits.max_batch + 1)
        ]
        return {name: max(dims[name] for dims in sizes) for name in sizes[-1]}

    def static_estimate(self) -> dict[tuple[ForwardMode, str], int]:
        """Bytes each static buffer will take, before any is made, in the modes a graph runner
        captures (decode, and target-verify when ``next_n`` > 1; ragged modes are planned into
        fresh tensors): each op field at the limits' largest shape, the staging buffer, and
        its host ring (``"staging (host)"``, pinned on CUDA; not counted by :meth:`nbytes`). A
        stepped mode (draft decode) keeps every buffer once per step."""
        out: dict[tuple[ForwardMode, str], int] = {}
        ring = RING if self.device.type == "cuda" else 1
        for mode, program in self.programs.items():
            if mode.ragged or (mode is ForwardMode.TARGET_VERIFY and self.limits.next_n == 1):
                continue
            steps = self.limits.draft_steps if mode.stepped else 1
            dims = self.max_dims(mode)
            for step in program.steps:
                shape = resolve_shape(step.spec.shape, dims, field=step.key)
                out[(mode, step.key)] = math.prod(shape) * step.spec.dtype.itemsize * steps
            staging = max(self.layout(mode, self.limits.max_batch).size, 1) * 4 * steps
            out[(mode, "staging")] = staging
            # each pinned buffer also holds the host ops' staged outputs (their device side
            # is counted as their fields, above)
            appendix = 4 * (appendix_words(staged_outputs(program)) + 1) if steps == 1 else 0
            out[(mode, "staging (host)")] = (staging + appendix) * ring
            if self.staging_in_graph:  # the ring the graphs pull from, beside the copy's
                out[(mode, "staging (pulled)")] = (staging + appendix) * SLOTS
        return out

    def check_budget(self) -> None:
        """Refuse limits whose static buffers would exceed ``Limits.max_static_bytes``, naming
        the field that takes the most, before anything is allocated."""
        estimate = self.static_estimate()
        total, budget = sum(estimate.values()), self.limits.max_static_bytes
        if total <= budget:
            return
        (mode, key), most = max(estimate.items(), key=lambda item: item[1])
        raise ConfigError(
            f"static plan buffers would take {_gib(total)}, over Limits.max_static_bytes "
            f"({_gib(budget)}); the largest is {key} in {mode.value} ({_gib(most)}), sized by "
            f"max_batch {self.limits.max_batch} and max_context {self.limits.max_context}: "
            "lower them, or raise max_static_bytes",
            field=key,
            expected=f"<= {budget} bytes",
            actual=f"{total} bytes",
        )

    def nbytes(self) -> int:
        """Bytes held in static buffers (plans and staging) for every captured mode."""
        total = 0
        for storages in self._static.values():
            total += sum(storage.nbytes for storage in storages)
            buf = storages[0].stager.device_buf
            total += buf.numel() * buf.element_size()
        return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
