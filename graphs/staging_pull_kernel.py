"""The pull kernel of ``planner.staging_pull``: a step's slot of the pinned ring into the
static device buffer, inside the captured graph. Triton is loaded on the first
:func:`pull_kernel` call, where a CUDA planner pulls (or a test runs the kernel under
``TRITON_INTERPRET=1``), so importing the planner core loads no Triton."""

from __future__ import annotations

import importlib
from typing import Any

tl: Any = None
"""``triton.language``, once :func:`pull_kernel` has loaded it (the kernel's body names it)."""
_kernels: dict[bool, object] = {}


def _pull(
    block_ptr,
    meta_ptr,
    counter_ptr,
    dst_ptr,
    words,
    SLOTS: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
):
    """One program: the slot of the counter's step into ``dst``, then the counter advanced.

    The slot's words are read uncached (``.cv``) and its tag volatile: the host rewrote
    them since the last graph, and no cached line may stand in for them."""
    seq = tl.load(counter_ptr)
    slot = seq % SLOTS
    tag = tl.load(meta_ptr + 2 + slot, volatile=True)
    ok = (tag >> 1) == seq
    # the words this pull copies: all of them for a slot staged for it, none otherwise
    limit = tl.where(ok & ((tag & 1) == 0), words, 0)
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < limit
        values = tl.load(block_ptr + slot * words + offs, mask=mask, cache_modifier=".cv")
        tl.store(dst_ptr + offs, values, mask=mask)
    tl.debug_barrier()  # every thread's reads of the slot are done before the ack
    error = tl.load(meta_ptr + 1, volatile=True)
    tl.store(meta_ptr + 1, tl.where(ok, error, seq + 1))
    tl.store(counter_ptr, seq + 1)
    tl.store(meta_ptr, seq + 1)


def pull_kernel() -> object:
    """:func:`_pull` under ``triton.jit``, decorated on first use per interpreter mode
    (``triton.jit`` fixes interpreter or compiler when it decorates)."""
    global tl
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
    knobs = getattr(triton, "knobs", None)
    interpret = bool(knobs.runtime.interpret) if knobs is not None else False
    kernel = _kernels.get(interpret)
    if kernel is None:
        kernel = _kernels[interpret] = triton.jit(_pull)
    return kernel
