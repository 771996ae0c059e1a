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
from planner.limits import Limits
from planner.materialise import FreshStorage, StaticStorage, batch_dims, source_segments
from planner.program import Program
from planner.staging import Ranges, Stager, StagingLayout, input_ranges


class Storages:
    """One planner's staging layouts, storages and input ranges."""

    def __init__(
        self,
        programs: Mapping[ForwardMode, Program],
        limits: Limits,
        device: torch.device,
    ) -> None:
        self.programs = programs
        self.limits = limits
        self.device = device
        self._layouts: dict[tuple[ForwardMode, int], StagingLayout] = {}
        self._fresh: dict[tuple[ForwardMode, int], FreshStorage] = {}
        self._static: dict[ForwardMode, StaticStorage] = {}
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
            )
        return ranges

    def fresh(self, mode: ForwardMode, reqs: int) -> FreshStorage:
        key = (mode, reqs)
        storage = self._fresh.get(key)
        if storage is None:
            program, layout = self.programs[mode], self.layout(mode, reqs)
            segments = source_segments(program, layout)
            stager = Stager(layout, self.device, static=False)
            storage = self._fresh[key] = FreshStorage(program, segments, stager)
        return storage

    def _max_dims(self, mode: ForwardMode) -> dict[str, int]:
        limits = self.limits
        return batch_dims(
            self.programs[mode],
            limits.page_size,
            limits.num_sms,
            reqs=limits.max_batch,
            max_len=limits.max_context,
            tokens=self.token_capacity(mode, limits.max_batch),
            kv_tokens=limits.max_batch * limits.max_context,
        )

    def static(self, mode: ForwardMode) -> StaticStorage:
        storage = self._static.get(mode)
        if storage is None:
            program = self.programs[mode]
            layout = self.layout(mode, self.limits.max_batch)
            segments = source_segments(program, layout)
            stager = Stager(layout, self.device, static=True)
            max_dims = self._max_dims(mode)
            storage = self._static[mode] = StaticStorage(program, segments, stager, max_dims)
        return storage

    def static_estimate(self) -> dict[tuple[ForwardMode, str], int]:
        """Bytes each static buffer will take, before any is made, in the modes a graph runner
        captures (decode, and target-verify when ``next_n`` > 1; ragged modes are planned into
        fresh tensors): each op field at the limits' largest shape, the staging buffer, and
        its host twin (``"staging (host)"``, pinned on CUDA; not counted by :meth:`nbytes`)."""
        out: dict[tuple[ForwardMode, str], int] = {}
        for mode, program in self.programs.items():
            if mode.ragged or (mode is ForwardMode.TARGET_VERIFY and self.limits.next_n == 1):
                continue
            dims = self._max_dims(mode)
            for step in program.steps:
                shape = resolve_shape(step.spec.shape, dims, field=step.key)
                out[(mode, step.key)] = math.prod(shape) * step.spec.dtype.itemsize
            staging = max(self.layout(mode, self.limits.max_batch).size, 1) * 4
            out[(mode, "staging")] = out[(mode, "staging (host)")] = staging
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
        return sum(storage.nbytes for storage in self._static.values())


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
