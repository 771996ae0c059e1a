"""What a capture leaves behind: the plans a graph reads, and how to tell they did not move.

A CUDA graph reads the addresses it was captured with. Replay hands back
these very plan objects; before it does, it checks that every plan tensor
still lives where capture put it and that host ops returned the handles
they returned at capture (always on: a pointer loop, microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ReplayError
from planner.materialise import Handles, StaticStorage, Tensors
from planner.planset import PlanSet
from planner.program import Step
from planner.staging import Ranges


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
    # What every replay of this size needs, resolved once at capture (the replay hot path):
    storage: StaticStorage | None = None
    dims: dict[str, int] = field(default_factory=dict)
    ranges: Ranges | None = None
    steps: tuple[Step, ...] = ()
    host_steps: tuple[Step, ...] = ()
    addresses: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.addresses = tuple(ptr for _, ptr in self.pointers)

    def check_unmoved(self, handles: Handles) -> None:
        """The plans a graph reads must still be where capture put them, handles included.

        One tuple comparison in the usual case; the field is looked for only when
        something moved.
        """
        for key, handle in handles.items():
            if handle is not self.handles.get(key):
                raise ReplayError(
                    "host op returned another handle than at capture", field=".".join(key)
                )
        if tuple(t.data_ptr() for t in self.plan_tensors) == self.addresses:
            return
        for tensor, (key, ptr) in zip(self.plan_tensors, self.pointers):
            if tensor.data_ptr() != ptr:
                raise ReplayError(
                    "plan tensor moved since capture",
                    field=key,
                    expected=hex(ptr),
                    actual=hex(tensor.data_ptr()),
                )


def dummy_batch(
    bs: int, mode: ForwardMode, next_n: int, req_to_token: torch.Tensor
) -> ForwardBatch:
    """What a capture runs its ops on: ``bs`` requests of the shortest legal length, all on the
    null request (row 0 of the token table, slot 0), so nothing real is read or written."""
    return ForwardBatch(
        seq_lens_cpu=torch.full((bs,), next_n, dtype=torch.int32),
        req_pool_indices=torch.zeros(bs, dtype=torch.int32),
        req_to_token=req_to_token,
        out_cache_loc=torch.zeros(bs * next_n, dtype=torch.int32),
        mode=mode,
        next_n=next_n,
    )
