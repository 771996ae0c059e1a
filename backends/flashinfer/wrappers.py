"""FlashInfer wrappers: one per captured (batch size, mode), planned from host lengths.

FlashInfer splits attention into ``plan`` (host: schedules work from the lengths,
copies it to the device) and ``run`` (per layer). Under CUDA graphs ``run`` is captured
once over fixed buffers, so each captured batch size needs its own wrapper built with
``use_cuda_graph=True`` over the planner's static plan tensors, re-planned in place
before every replay: the ``flashinfer_plan`` provider, called with ``static=True`` over the
captured tensors, finds the slot its capture made and plans it through FlashInfer's
scheduler alone where capture proved that equal to ``plan()`` (``direct_plan``), else
through ``plan()``. Eager plans share one ordinary wrapper per configuration.

Two hazards are handled here rather than left to callers:

- no device-to-host sync: ``plan`` calls ``.to("cpu")`` on the index arrays it
  is given, so it always receives host copies computed from the batch's host
  lengths (``seq_lens_cpu``), never the device plan fields;
- no race on pinned memory: ``plan`` enqueues asynchronous copies out of
  pinned host buffers (ours and FlashInfer's own). Before a slot refills them
  for the next batch it waits for the event recorded after its previous plan.

``flashinfer`` is imported on first use, so this module works on any CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from backends.common.pinned import PinnedCopies
from backends.flashinfer import direct_plan
from backends.flashinfer.config import WrapperConfig
from backends.flashinfer.direct_plan import DirectPlan
from backends.flashinfer.host_args import HostArgs
from planner.errors import ProviderError

__all__ = [
    "POOL",
    "HostArgs",
    "PlanSlot",
    "WrapperConfig",
    "WrapperHandle",
    "WrapperPool",
    "flashinfer_importable",
    "load_flashinfer",
    "release_wrappers",
]

_module: ModuleType | None = None
"""The imported (or, in tests, injected) flashinfer module."""


_failure: str | None = None
"""Why flashinfer could not be imported (remembered: a broken install stays broken)."""


def flashinfer_importable() -> bool:
    """Whether flashinfer imports; tried once, on the first CUDA planner that asks.

    ``find_spec`` alone would choose a broken install (an ``OSError`` from an ABI
    mismatch, a missing symbol) and fail at the first plan; a real import
    catches it here, and the planner falls back to the torch bookkeeping. The
    first failure is said once.
    """
    global _failure
    if _module is not None:
        return True
    if _failure is not None:
        return False
    try:
        if importlib.util.find_spec("flashinfer") is None:
            raise ModuleNotFoundError("flashinfer is not installed")
        load_flashinfer()
        return True
    except Exception as exc:  # ImportError, OSError (ABI), RuntimeError (no CUDA)
        cause = exc.__cause__ if isinstance(exc, ProviderError) and exc.__cause__ else exc
        _failure = f"{type(cause).__name__}: {cause}"
        warnings.warn(
            f"flashinfer is unavailable ({_failure}); FlashInfer plans use the torch "
            "bookkeeping and layers the torch reference attention",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


def load_flashinfer() -> ModuleType:
    """Import flashinfer on first use (it JIT-compiles kernels and needs CUDA)."""
    global _module
    if _module is None:
        try:
            _module = importlib.import_module("flashinfer")
        except Exception as exc:  # ImportError, or OSError from an ABI mismatch
            raise ProviderError(
                "flashinfer is not importable", field="flashinfer", actual=repr(exc)
            ) from exc
    return _module


class PlanSlot:
    """One wrapper (``None`` without flashinfer), its host arrays, and the event guarding them."""

    def __init__(
        self,
        config: WrapperConfig,
        reqs: int,
        device: torch.device,
        wrapper: Any,
        bound: tuple[torch.Tensor, ...] | None,
    ) -> None:
        self.config = config
        self.device = device
        self.wrapper = wrapper
        self.bound = bound  # graph slots: the static plan tensors the wrapper reads
        self._pin = device.type == "cuda"
        self.args = HostArgs(reqs, self._pin)
        self._copies = PinnedCopies(self._pin, device)
        self.plans = 0
        self.handle: WrapperHandle | None = None
        self.direct: DirectPlan | None = None
        """Graph slots, once proven at capture: the scheduler call replays make instead of
        ``plan()`` (``backends.flashinfer.direct_plan``)."""

    @property
    def static(self) -> bool:
        return self.bound is not None

    def serves(
        self, config: WrapperConfig, use_flashinfer: bool, bound: tuple[torch.Tensor, ...]
    ) -> bool:
        """A graph slot of this configuration and provider, bound to these very tensors
        (checked by identity, four by name: a replay's cost)."""
        mine = self.bound
        return (
            mine is not None
            and self.config is config
            and (self.wrapper is not None) is use_flashinfer
            and len(bound) == 4
            and mine[0] is bound[0]
            and mine[1] is bound[1]
            and mine[2] is bound[2]
            and mine[3] is bound[3]
        )

    def plan(
        self, seq_lens_cpu: torch.Tensor, reqs: int, kv_indices: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Fill the host arrays, plan the wrapper, record the summary in ``out``; no device
        sync. The one way a slot is planned: a graph slot through its direct scheduler call
        once capture has proven it, else (and every eager slot) through ``plan()``."""
        self._copies.before_refill()  # our previous plan's async copies may still read them
        if reqs > self.args.capacity:  # eager slots grow to the largest batch seen
            self.args = HostArgs(reqs, self._pin)
        c = self.config
        self.args.fill(seq_lens_cpu, reqs, c.page_size, c.next_n)
        if self.direct is not None:
            self.direct(self.args)
        elif self.wrapper is not None:
            self._plan_wrapper(kv_indices)
            if self.static and self.plans == 0:
                self.direct = self._prove_direct(kv_indices)
        out.copy_(self.args.summary, non_blocking=self._pin)
        self._copies.after_enqueue()
        self.plans += 1

    def _prove_direct(self, kv_indices: torch.Tensor) -> DirectPlan | None:
        """At capture: the direct scheduler call, if it plans a probe batch exactly as
        ``plan()`` does; the wrapper is then planned again for this batch."""
        c = self.config
        direct = direct_plan.candidate(self.wrapper, c)
        if direct is None:
            return None
        reqs = self.args.reqs
        probe = HostArgs(reqs, self._pin)
        longest = kv_indices.shape[0] // reqs * c.page_size
        lens = direct_plan.probe_lengths(reqs, longest, c.next_n)
        probe.fill(lens, reqs, c.page_size, c.next_n)
        proven = direct_plan.prove(
            self.wrapper,
            c,
            direct,
            lambda args: self._plan_wrapper(kv_indices, args),
            probe,
            self.device,
        )
        self._plan_wrapper(kv_indices)  # the probe's plan is in the buffers: this batch's again
        return direct if proven else None

    def _plan_wrapper(self, kv_indices: torch.Tensor, args: HostArgs | None = None) -> None:
        # kv_indices: the plan's own device field, cut to the pages in use. In graph
        # mode FlashInfer copies it onto its buffer, which is that same memory, and
        # torch skips a copy between identical views; eager wrappers keep a reference.
        c, a = self.config, (args if args is not None else self.args)
        indices = kv_indices[: a.total_pages]
        if c.kind == "decode":
            self.wrapper.plan(
                a.kv_indptr,
                indices,
                a.last_page_len,
                c.heads,
                c.kv_heads,
                c.head_dim,
                c.page_size,
                q_data_type=c.q_dtype,
                kv_data_type=c.kv_dtype,
                sm_scale=c.sm_scale,
                non_blocking=True,
            )
        else:
            self.wrapper.plan(
                a.qo_indptr,
                a.kv_indptr,
                indices,
                a.kv_lens,
                c.heads,
                c.head_dim,
                c.rope_dim,
                c.page_size,
                c.causal,
                c.sm_scale,
                c.q_dtype,
                c.kv_dtype,
            )


@dataclass(frozen=True)
class WrapperHandle:
    """What a plan carries: the slot its wrapper was planned in, and for eager plans, which plan.

    A graph slot is re-planned in place before every replay of its graph, so
    its handle is always current. The eager slot is shared and re-planned by
    every eager plan; ``generation`` tells a superseded eager plan from the
    current one, so it is refused instead of running with a newer batch's
    schedule.
    """

    slot: PlanSlot
    generation: int | None

    @property
    def current(self) -> bool:
        return self.generation is None or self.generation == self.slot.plans


def captured_slot(graph: Mapping[int, tuple[torch.Tensor, Any]], out: torch.Tensor, *args: Any):
    """The graph slot a capture made for the output ``out`` (that very tensor: a replay is
    handed the captured tensors), if it still ``serves(*args)``; else None."""
    known = graph.get(id(out))
    if known is not None and known[0] is out and known[1].serves(*args):
        return known[1]
    return None


class WrapperPool:
    """Every slot of the process: graph slots keyed by the static tensors they are bound to
    (one per captured size and mode), eager slots by configuration."""

    def __init__(self) -> None:
        self._slots: dict[tuple, PlanSlot] = {}
        self._workspaces: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._graph: dict[int, tuple[torch.Tensor, PlanSlot]] = {}
        """Graph slots by their summary tensor's id, checked by identity: a replay hands the
        provider the very tensors of its capture, so it finds its slot without hashing the
        configuration and the pointers (several us a replay)."""

    def plan(
        self,
        config: WrapperConfig,
        *,
        static: bool,
        use_flashinfer: bool,
        seq_lens_cpu: torch.Tensor,
        bound: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        out: torch.Tensor,
    ) -> WrapperHandle:
        """Plan the slot for these plan tensors (``qo_indptr, kv_indptr, kv_indices, kv_tail``).

        ``static``: capture and replay, over the captured tensors. A replay finds the graph
        slot its capture made and plans it as :meth:`PlanSlot.plan` does (the direct
        scheduler call where capture proved it), handing back the captured handle."""
        if static:
            slot = captured_slot(self._graph, out, config, use_flashinfer, bound)
            if slot is not None:
                slot.plan(seq_lens_cpu, slot.args.capacity, bound[2], out)
                return slot.handle
        kv_indptr, kv_indices = bound[1], bound[2]
        reqs = kv_indptr.shape[0] - 1
        device = kv_indptr.device
        if static:
            key = (config, device, use_flashinfer, reqs, tuple(t.data_ptr() for t in bound))
        else:
            key = (config, device, use_flashinfer, "eager")
        slot = self._slots.get(key)
        if slot is None or (
            static and any(a is not b for a, b in zip(slot.bound, bound, strict=True))
        ):
            wrapper = self._new_wrapper(config, static, bound, device) if use_flashinfer else None
            slot = PlanSlot(config, reqs, device, wrapper, bound if static else None)
            self._slots[key] = slot
        slot.plan(seq_lens_cpu, reqs, kv_indices, out)
        if not static:
            return WrapperHandle(slot, slot.plans)
        if slot.handle is None:  # one handle per graph slot: replay hands back the captured one
            slot.handle = WrapperHandle(slot, None)
        self._graph[id(out)] = (out, slot)
        return slot.handle

    def slots(self) -> list[PlanSlot]:
        return list(self._slots.values())

    def release(self) -> None:
        """Drop every wrapper, workspace and reference to planner buffers (e.g. between tests)."""
        self._slots.clear()
        self._workspaces.clear()
        self._graph.clear()

    def workspace(self, device: torch.device, mb: int) -> torch.Tensor:
        """One float workspace per (device, size), shared: wrappers run one after another on one stream."""
        key = (device, mb)
        if key not in self._workspaces:
            self._workspaces[key] = torch.zeros(mb << 20, dtype=torch.uint8, device=device)
        return self._workspaces[key]

    def _new_wrapper(
        self, c: WrapperConfig, static: bool, bound: tuple[torch.Tensor, ...], device: torch.device
    ) -> Any:
        fi = load_flashinfer()
        workspace = self.workspace(device, c.workspace_mb)
        qo_indptr, kv_indptr, kv_indices, kv_tail = bound
        if c.kind == "decode":
            if c.next_n > 1:
                raise ProviderError(
                    "FlashInfer's decode wrapper plans one query token per request; target-verify "
                    "needs the prefill wrapper, which this backend does not plan yet",
                    field="flashinfer_decode.next_n",
                    expected=1,
                    actual=c.next_n,
                )
            if not static:
                return fi.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=c.use_tensor_cores
                )
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=c.use_tensor_cores,
                paged_kv_indptr_buffer=kv_indptr,
                paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=kv_tail,
            )
        if not static:
            return fi.BatchMLAPagedAttentionWrapper(workspace, backend=c.backend)
        return fi.BatchMLAPagedAttentionWrapper(
            workspace,
            use_cuda_graph=True,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=kv_tail,
            backend=c.backend,
        )


POOL = WrapperPool()
"""The process's wrappers; plans carry a handle to theirs."""


def release_wrappers() -> None:
    """Free every FlashInfer wrapper and the planner buffers they hold (see ``WrapperPool.release``)."""
    POOL.release()
