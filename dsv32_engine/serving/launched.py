"""A forward launched whose sampled tokens are still on their way to the host."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsv32_engine.serving.requests import Request
from planner.batch import ForwardMode
from planner.step_reads import PendingRead


@dataclass
class Launched:
    """A forward launched whose sampled tokens are still on their way to the host: taken by
    :meth:`DecodeEngine._take`, at once in the synchronous loop, a loop step later in the
    overlapped one."""

    read: PendingRead
    rows: list[tuple[Request, bool, bool]]
    """Each output row's request, whether the forward fed it prompt tokens, and whether its
    token is kept (the prompt is done)."""
    mode: ForwardMode
    started: float
    """perf_counter when its launch began."""
    forward: int
    """Its forward step number (``DecodeEngine.forward_steps`` at launch), for errors."""
    prefilled: int = 0
    """Prompt tokens it fed."""
    fed_from_device: list[tuple[int, Request, int]] = field(default_factory=list)
    """Debug mode: each input id read from the device, as (row, request, position)."""
    ids: torch.Tensor | None = None
    """Debug mode: the input ids it fed (on the device)."""
    after: Callable[[], None] | None = None
    """What runs once its tokens are taken (the MTP draft's catch-up: each request's draft
    row picked)."""
