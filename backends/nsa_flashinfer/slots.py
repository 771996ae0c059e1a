"""FlashInfer MLA wrappers planned over the indexer's top-k slots: one per captured size.

FlashInfer's MLA kernel reads a page-1 KV list, ``kv_indices[kv_indptr[r] + t]`` for
``t < kv_len[r]``. Over the top-k of DeepSeek-V3.2 that list is each row's selected
slots, so the layout is static: row ``r`` owns ``[r * topk, (r + 1) * topk)`` of one
``rows * topk`` buffer, and only ``kv_len[r] = min(kv_len_r, topk)`` changes per batch.
That is what makes one plan serve all 61 layers: ``plan()`` schedules the work from the
lengths (the same in every layer), and each layer only writes its own slots into the
slot's index buffer before ``run`` (inside the graph when captured).

Two costs are avoided rather than paid:

- ``plan()`` takes 70-180 us of host time on the H200 (r5-1). It is a function of the
  row lengths alone, and once every context is past ``topk`` they stop changing, so a
  slot re-plans only when its host lengths differ from the ones it last planned with.
  Each wrapper owns its integer workspace (where the schedule lives), so a skipped
  plan leaves a valid schedule in place.
- no device-to-host sync: the lengths come from the batch's host ``seq_lens_cpu``.
  Pinned host arrays are refilled only after the event recorded after the previous
  plan's asynchronous copies.

The kernel never reads the plan's device tables; they are kept in the plan so the
CPU reference (and ``inspect``) read exactly what FlashInfer was planned with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.common.pinned import PinnedCopies
from backends.flashinfer.wrappers import POOL, captured_slot, load_flashinfer

__all__ = ["SPARSE_POOL", "SparseConfig", "SparseHandle", "SparseSlot", "row_lengths"]


@dataclass(frozen=True)
class SparseConfig:
    """What a wrapper is planned for, besides the lengths (hashable: it keys the pool)."""

    topk: int
    next_n: int
    heads: int
    latent: int
    rope: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float
    workspace_mb: int
    backend: str


def row_lengths(seq_lens: np.ndarray, reqs: int, next_n: int, topk: int) -> np.ndarray:
    """Each query row's sparse length ``min(causal kv_len, topk)``: what the plan's
    ``causal_lengths`` op writes (row ``r * next_n + i`` reads ``seq_len - (next_n - 1 - i)``)
    over the requests padded as the planner pads them (``seq_len = next_n``, so their rows
    read 1..next_n tokens), clamped to ``topk``."""
    lens = np.full(reqs, next_n, dtype=np.int32)
    lens[: seq_lens.shape[0]] = seq_lens
    rows = (lens[:, None] - np.arange(next_n - 1, -1, -1, dtype=np.int32)).reshape(-1)
    return np.minimum(rows, topk, out=rows)


def summary_of(lens: np.ndarray, real_rows: int) -> list[int]:
    """``[rows, real rows, top-k tokens read, longest]``: what a plan was made for."""
    return [int(lens.shape[0]), real_rows, int(lens.astype(np.int64).sum()), int(lens.max())]


class SparseSlot:
    """One wrapper (``None`` without flashinfer), its index buffer, host arrays and memo.

    A graph slot serves one captured size; the eager slot is shared by every eager plan
    and grows to the most rows seen (its wrapper is planned over the first ``rows``).
    """

    def __init__(
        self, config: SparseConfig, capacity: int, device: torch.device, static: bool, use_fi: bool
    ) -> None:
        self.config = config
        self.device = device
        self.static = static
        self.capacity = capacity
        self._pin = device.type == "cuda"
        offsets = torch.arange(capacity + 1, dtype=torch.int32)
        self._qo_indptr = offsets.pin_memory() if self._pin else offsets
        self._kv_indptr = (
            (offsets * config.topk).pin_memory() if self._pin else offsets * config.topk
        )
        self._kv_len = torch.zeros(capacity, dtype=torch.int32, pin_memory=self._pin)
        self.summary = torch.zeros(4, dtype=torch.int64, pin_memory=self._pin)
        self.kv_indices = torch.zeros(capacity * config.topk, dtype=torch.int32, device=device)
        """The layers' slots, row ``r`` at ``[r * topk, (r + 1) * topk)``; FlashInfer reads it."""
        self.wrapper = self._new_wrapper() if use_fi else None
        self._copies = PinnedCopies(self._pin, device)
        self._clamp = config.topk + config.next_n - 1
        """Row lengths depend on a request's length only up to this (``topk`` past the
        first row's causal offset): the memo compares lengths clamped to it."""
        self._scratch = np.zeros(capacity, dtype=np.int32)
        self._planned: tuple[int, bytes] | None = None
        self.plans = 0
        """Times this slot was (re)planned: eager handles compare their generation to it."""
        self.skipped = 0
        """Batches whose lengths matched the last plan: no ``plan()`` call."""
        self.handle: SparseHandle | None = None

    def serves(self, config: SparseConfig, use_flashinfer: bool, rows: int) -> bool:
        """A graph slot of this configuration and provider, for ``rows`` rows."""
        return (
            self.static
            and self.config is config
            and (self.wrapper is not None) is use_flashinfer
            and self.capacity == rows
        )

    def _new_wrapper(self) -> Any:
        fi = load_flashinfer()
        c, rows = self.config, self.capacity
        workspace = POOL.workspace(self.device, c.workspace_mb)
        if not self.static:
            return fi.BatchMLAPagedAttentionWrapper(workspace, backend=c.backend)

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        return fi.BatchMLAPagedAttentionWrapper(
            workspace,
            use_cuda_graph=True,
            qo_indptr=i32(rows + 1),
            kv_indptr=i32(rows + 1),
            kv_indices=self.kv_indices,
            kv_len_arr=i32(rows),
            backend=c.backend,
        )

    def plan(self, seq_lens_cpu: torch.Tensor, rows: int, out: torch.Tensor) -> None:
        """Plan the first ``rows`` rows for this batch's lengths unless they are the ones
        last planned; the summary goes to ``out`` either way (captured sizes' static
        buffers share storage, so another size may have written there since). No sync."""
        c = self.config
        seq = seq_lens_cpu.numpy()
        clamped = self._scratch[: seq.shape[0]]
        np.minimum(seq, self._clamp, out=clamped)
        key = (rows, clamped.tobytes())
        if key == self._planned:
            self.skipped += 1
            out.copy_(self.summary, non_blocking=self._pin)
            return
        self._copies.before_refill()  # the previous plan's async copies may still read them
        lens = row_lengths(seq, rows // c.next_n, c.next_n, c.topk)
        kv_len = self._kv_len[:rows]
        kv_len.numpy()[:] = lens
        self.summary.numpy()[:] = summary_of(lens, seq.shape[0] * c.next_n)
        if self.wrapper is not None:
            self.wrapper.plan(
                self._qo_indptr[: rows + 1],
                self._kv_indptr[: rows + 1],
                # a graph wrapper copies this onto its own index buffer, which is this
                # same memory: an empty view skips that device copy; the eager wrapper
                # keeps what it is given
                self.kv_indices[: 0 if self.static else rows * c.topk],
                kv_len,
                c.heads,
                c.latent,
                c.rope,
                1,  # page size: every slot is its own page
                False,  # each row's own selected slots: no causal mask inside the list
                c.sm_scale,
                c.q_dtype,
                c.kv_dtype,
            )
        out.copy_(self.summary, non_blocking=self._pin)
        self._copies.after_enqueue()
        self._planned = key
        self.plans += 1


@dataclass(frozen=True)
class SparseHandle:
    """What a plan carries: its slot, and for eager plans which plan of the shared slot."""

    slot: SparseSlot
    generation: int | None

    @property
    def current(self) -> bool:
        return self.generation is None or self.generation == self.slot.plans


class SparsePool:
    """Graph slots keyed by the static plan buffer they serve (one per captured size and
    mode), eager slots by configuration (grown to the largest batch seen)."""

    def __init__(self) -> None:
        self._slots: dict[tuple, SparseSlot] = {}
        self._graph: dict[int, tuple[torch.Tensor, SparseSlot]] = {}
        """Graph slots by their output tensor's id, checked by identity: a replay hands the
        provider the very tensors of its capture, so it finds its slot without hashing the
        configuration."""

    def plan(
        self,
        config: SparseConfig,
        *,
        static: bool,
        use_flashinfer: bool,
        rows: int,
        seq_lens_cpu: torch.Tensor,
        out: torch.Tensor,
    ) -> SparseHandle:
        """Plan the slot of this configuration and static buffer (or the eager slot).

        ``static``: capture and replay, over the captured tensors. A replay finds the graph
        slot its capture made and hands back the captured handle."""
        if static:
            slot = captured_slot(self._graph, out, config, use_flashinfer, rows)
            if slot is not None:
                slot.plan(seq_lens_cpu, rows, out)
                return slot.handle
            key = (config, use_flashinfer, rows, out.data_ptr())
        else:
            key = (config, use_flashinfer, out.device)
        slot = self._slots.get(key)
        if slot is None or slot.capacity < rows:  # eager slots grow to the largest batch
            slot = SparseSlot(config, rows, out.device, static, use_flashinfer)
            self._slots[key] = slot
        slot.plan(seq_lens_cpu, rows, out)
        if not static:
            return SparseHandle(slot, slot.plans)
        self._graph[id(out)] = (out, slot)
        if slot.handle is None:
            slot.handle = SparseHandle(slot, None)
        return slot.handle

    def release(self) -> None:
        self._slots.clear()
        self._graph.clear()


SPARSE_POOL = SparsePool()
"""The process's sparse wrappers; plans carry a handle to theirs."""
