"""A test module's planner configuration, with the token table its batches index.

Most planner tests build planners of one configuration (backends, limits, options) over
one token table and draw random batches from it; ``PlannerSetup`` holds the three, so a
module states its configuration once. ``capture_all`` and ``replay_smallest`` are the
capture and replay steps the three-phase tests share.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from tests.support.batches import make_pool, random_batch


@contextlib.contextmanager
def pretend_cuda() -> Iterator[None]:
    """CUDA looks present (one device) while this runs: ``Limits(device="cuda:0")`` refuses a
    machine without CUDA, but a CUDA planner's provider choice and door checks touch no GPU,
    so the fault and device tests build its limits under this."""
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "device_count", return_value=1),
    ):
        yield


@dataclass(frozen=True)
class PlannerSetup:
    """Backends, limits and options of the planners a module builds, and their token table.

    ``table`` is ``make_pool(pool, max_context, page_size, seed)``: row 0 the null request,
    every other row owning shuffled whole pages.
    """

    backends: tuple[str, ...]
    max_batch: int
    max_context: int
    page_size: int
    pool: int = 16
    seed: int = 0
    limits: Mapping[str, Any] = field(default_factory=dict)
    """More ``Limits`` fields (``next_n``, ``kv_slots``, ``num_sms``, ``device``)."""
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Backend options; a planner gets those of the backends it plans."""
    table: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        table = make_pool(self.pool, self.max_context, self.page_size, seed=self.seed)
        object.__setattr__(self, "table", table)

    def make_limits(self, *, fake_cuda: bool = False, **overrides: Any) -> Limits:
        """The setup's limits with ``overrides``; ``fake_cuda`` builds them under
        :func:`pretend_cuda` (a CUDA device on a machine without one)."""
        base = dict(max_batch=self.max_batch, max_context=self.max_context)
        values = {**base, "page_size": self.page_size, **self.limits, **overrides}
        with pretend_cuda() if fake_cuda else contextlib.nullcontext():
            return Limits(**values)

    def planner(self, backends: Sequence[str] | None = None, **kwargs: Any) -> Planner:
        """A planner of ``backends`` (default: the setup's); keywords naming a ``Limits``
        field (or ``fake_cuda``) go to :meth:`make_limits`, the others to ``Planner``."""
        names = list(backends or self.backends)
        limit_keys = {*Limits.model_fields, "fake_cuda"}
        limits = {k: kwargs.pop(k) for k in list(kwargs) if k in limit_keys}
        options = {b: dict(o) for b, o in self.options.items() if b in names}
        if options:
            kwargs.setdefault("options", options)
        return Planner(names, self.make_limits(**limits), **kwargs)

    def batch(self, rng: random.Random, **kwargs: Any) -> ForwardBatch:
        """``random_batch`` over the setup's table (``max_batch`` defaults to the setup's)."""
        kwargs.setdefault("max_batch", self.max_batch)
        return random_batch(rng, self.table, max_context=self.max_context, **kwargs)


def pointers(plans: PlanSet) -> dict[str, int]:
    """``backend.field`` -> data pointer of every tensor of a plan set."""
    return {f"{b}.{k}": t.data_ptr() for b in plans for k, t in plans[b].tensors().items()}


def capture_all(
    planner: Planner, sizes: Iterable[int], modes: Iterable[ForwardMode], table: torch.Tensor
) -> dict[tuple[ForwardMode, int], tuple[PlanSet, dict[str, int]]]:
    """Capture every (mode, size); each plan set with its pointers as captured."""
    captured = {}
    for mode in modes:
        for bs in sizes:
            plans = planner.capture(bs, mode, req_to_token=table)
            captured[(mode, bs)] = (plans, pointers(plans))
    return captured


def replay_smallest(
    planner: Planner, batch: ForwardBatch, sizes: Iterable[int]
) -> tuple[int, PlanSet]:
    """Replay ``batch`` at the smallest of ``sizes`` that holds it, then ``record`` (what a
    graph replay runs before the layers); the size and the replayed plans."""
    bs = min(s for s in sizes if s >= batch.bs)
    plans = planner.replay(batch, bs)
    planner.record(bs, batch.plans_as)
    return bs, plans
