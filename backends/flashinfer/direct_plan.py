"""Re-planning a graph slot's wrapper with FlashInfer's scheduler alone.

Why: a wrapper's ``plan()`` is Python around one compiled scheduler call, and in a graph
slot most of that Python repeats what the planner has already done. It copies the host
page tables into device buffers that are the planner's own static plan fields (which its
ops recompute inside the graph); the decode wrapper derives every request's length with
torch ops on the host (``get_seq_lens``) that its non-tensor-core scheduler never reads;
and it re-checks arguments that cannot change for one slot. Measured in round 7, that
Python is most of a replay's FlashInfer time. What a replay needs is the scheduler's
output: the plan info, and the int workspace it copies to the device.

So after ``plan()`` has set a graph wrapper up (its module, workspaces, cached dtypes),
replays call the scheduler with the slot's host arrays, the arguments ``plan()`` itself
passes. This is FlashInfer-version specific, so it is proven per slot, not assumed: at
capture, for lengths that exercise the scheduler (not the dummy batch's), both ways must
give the same plan info and the same pinned workspace bytes. Anything else (another
version's signature, the tensor-core or trtllm-gen decode, a mismatch) keeps ``plan()``,
said once. Eager wrappers always use ``plan()``: they are rebound to fresh tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.flashinfer.host_args import HostArgs
from planner.errors import warn_once

DirectPlan = Callable[[HostArgs], None]

_SENTINEL = 0x5A
"""Written over the pinned workspace before each of the two proof plans, so bytes either
scheduler left untouched compare equal and bytes it wrote must agree."""


def _workspaces(wrapper: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
    )


def _decode(wrapper: Any, config: Any) -> DirectPlan | None:
    if wrapper._use_tensor_cores or getattr(wrapper, "_backend", None) == "trtllm-gen":
        return None  # these read lengths and keep more state than the plan info
    module, spaces = wrapper._cached_module, _workspaces(wrapper)
    window, cap = wrapper._window_left, wrapper._logits_soft_cap
    q_empty = torch.empty(0, dtype=config.q_dtype)
    kv_empty = torch.empty(0, dtype=config.kv_dtype)
    heads, kv_heads, page, dim = config.heads, config.kv_heads, config.page_size, config.head_dim

    def plan(args: HostArgs) -> None:
        wrapper._plan_info = module.plan(
            *spaces,
            args.kv_indptr,
            args.reqs,
            heads,
            kv_heads,
            page,
            True,  # the wrapper is a CUDA-graph one: graph slots only come here
            window,
            cap,
            dim,
            dim,
            q_empty,
            kv_empty,
        )

    return plan


def _mla(wrapper: Any, config: Any) -> DirectPlan | None:
    module, spaces = wrapper._cached_module, _workspaces(wrapper)
    heads, dim, causal = config.heads, config.head_dim, config.causal

    def plan(args: HostArgs) -> None:
        wrapper._plan_info = module.plan(
            *spaces, args.qo_indptr, args.kv_indptr, args.kv_lens, heads, dim, causal
        )

    return plan


def candidate(wrapper: Any, config: Any) -> DirectPlan | None:
    """The direct scheduler call for a graph wrapper ``plan()`` has set up, or None where
    this wrapper is not one this module knows (checked by attribute, not by version)."""
    if not getattr(wrapper, "_use_cuda_graph", False):
        return None
    try:
        make = _decode if config.kind == "decode" else _mla
        return make(wrapper, config)
    except AttributeError:  # not the wrapper layout this was written against
        return None


def probe_lengths(reqs: int, longest: int, next_n: int) -> torch.Tensor:
    """Lengths that make the scheduler work (mixed, several pages, some split): the
    dummy batch's (all ``next_n``) would prove almost nothing."""
    top = max(longest, next_n)
    values = [next_n + (r * 7919 + top // 3) % (top - next_n + 1) for r in range(reqs)]
    values[0] = top  # one request as long as the slot allows
    return torch.tensor(values, dtype=torch.int32)


def prove(
    wrapper: Any,
    config: Any,
    direct: DirectPlan,
    plan_with: Callable[[HostArgs], None],
    probe: HostArgs,
    device: torch.device,
) -> bool:
    """Whether ``direct`` schedules ``probe`` exactly as ``plan_with`` (FlashInfer's
    ``plan()``) does: the same plan info and the same pinned workspace bytes.

    Capture-time only: it synchronises, so the pinned workspace is not rewritten under a
    copy still reading it.
    """
    pinned = wrapper._pin_memory_int_workspace_buffer
    results = []
    try:
        for run in (plan_with, direct):
            _sync(device)
            pinned.fill_(_SENTINEL)
            run(probe)
            _sync(device)
            results.append((as_list(wrapper._plan_info), pinned.clone()))
    except Exception as exc:  # another version's signature, a refused argument
        warn_once(
            f"FlashInfer {config.kind} slots keep plan(): the direct scheduler call failed "
            f"({type(exc).__name__}: {exc})"
        )
        return False
    (info_a, bytes_a), (info_b, bytes_b) = results
    same = info_a == info_b and torch.equal(bytes_a, bytes_b)
    if not same:
        warn_once(
            f"FlashInfer {config.kind} slots keep plan(): the direct scheduler call planned "
            "differently from plan() for the same lengths"
        )
    return same


def as_list(info: Any) -> list:
    """Plan info as a list to compare: FlashInfer returns a list, an FFI array or a tensor,
    depending on the version and the kernel."""
    if info is None:
        return []
    return info.tolist() if hasattr(info, "tolist") else list(info)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
