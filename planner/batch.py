"""The forward batch a scheduler hands the planner, and the names of its inputs.

A plain frozen dataclass rather than a pydantic model: one is built every
step on the hot path, and the planner checks it itself at the door
(``planner.door``) with messages that name the field and the limit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(str, enum.Enum):
    """What the forward computes: one token per request, or ``next_n`` to verify."""

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"


BATCH = "batch"
"""Owner name of the batch's own tensors in the planner's tables (no backend may take it)."""

BATCH_TABLES = frozenset({"req_to_token"})
"""Device tables the engine owns; ops read them in place and graphs bind their address."""

HOST_INPUTS = frozenset({"seq_lens_cpu"})
"""Host tensors of the batch a host op (``graph_safe=False``) may read, e.g. FlashInfer's plan."""

SOURCES = {"seq_lens": False, "req_pool_indices": False, "positions": True, "out_cache_loc": True}
"""Batch inputs a schema can stage with ``source=``, and whether each has a row per token."""


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's batch.

    ``seq_lens_cpu`` is the KV length of each request *including* this step's
    new tokens (``next_n`` of them in target-verify). ``req_pool_indices``,
    ``positions`` and ``out_cache_loc`` may live on the host (staged with the
    lengths in one copy) or already on the device. ``seq_lens`` is the optional
    device copy an engine may already hold.
    """

    seq_lens_cpu: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    mode: ForwardMode = ForwardMode.DECODE
    next_n: int = 1

    @property
    def bs(self) -> int:
        """Requests in the batch."""
        shape = self.seq_lens_cpu.shape
        return shape[0] if len(shape) == 1 else -1

    @property
    def num_tokens(self) -> int:
        """Query tokens in the batch: ``bs * next_n``."""
        return self.bs * self.next_n

    def source(self, name: str) -> torch.Tensor:
        """The batch input a schema's ``source=`` names (positions derived if absent)."""
        if name == "seq_lens":
            return self.seq_lens_cpu
        if name == "positions" and self.positions is None:
            return derive_positions(self.seq_lens_cpu, self.next_n)
        return getattr(self, name)


def derive_positions(seq_lens_cpu: torch.Tensor, next_n: int) -> torch.Tensor:
    """Positions of this step's tokens when the engine gives none: the last ``next_n`` slots."""
    offsets = torch.arange(next_n - 1, -1, -1, dtype=torch.int32)
    return (seq_lens_cpu.to(torch.int32)[:, None] - 1 - offsets[None, :]).reshape(-1)
