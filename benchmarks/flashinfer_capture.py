"""Capture of every size for benchmarks/verify_flashinfer.py: one CUDA graph pool, or emulated.

Largest size first into one pool, as the graph runner does; the warm-up forward is
checked against the reference too (the capture-time dummy batch). On the CPU the
"graph" re-runs ``planner.record`` + the forward over the same static tensors, so the
script's logic runs without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.flashinfer_report import max_err
from benchmarks.flashinfer_setup import Setup


@dataclass
class Captured:
    bs: int
    plans: Any
    statics: tuple[torch.Tensor, ...]
    out: torch.Tensor | None
    replay: Callable[[], torch.Tensor]
    pointers: dict[str, int]
    slot: Any
    warmup_err: float


def capture_all(setup: Setup, g: torch.Generator) -> dict[int, Captured]:
    """Largest size first into one pool, as the graph runner does; warm-up checked too."""
    c, planner = setup.config, setup.planner
    cuda = setup.device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if cuda else None
    top = max(c.sizes) * c.next_n
    statics = tuple(torch.zeros_like(t) for t in setup.inputs(top, g))
    captured: dict[int, Captured] = {}
    for bs in sorted(c.sizes, reverse=True):
        plans = planner.capture(bs, c.mode, req_to_token=setup.table)
        views = tuple(t[: bs * c.next_n] for t in statics)
        for view, value in zip(views, setup.inputs(bs * c.next_n, g), strict=True):
            view.copy_(value)
        warm = setup.forward(plans, views, "auto")  # JIT, allocator, and a capture-phase check
        err = max_err(warm, setup.reference(plans, views))
        plan = plans[c.backend]
        pointers = {name: t.data_ptr() for name, t in plan.tensors().items()}
        slot = plan.wrapper.slot
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                planner.record(bs, c.mode)
                out = setup.forward(plans, views, "auto")

            def replay(graph=graph, out=out) -> torch.Tensor:
                graph.replay()
                return out

        else:  # emulated: re-run the captured callable over the same static tensors

            def replay(bs=bs, plans=plans, views=views) -> torch.Tensor:
                planner.record(bs, c.mode)
                return setup.forward(plans, views, "auto")

            out = None
        captured[bs] = Captured(bs, plans, views, out, replay, pointers, slot, err)
    return captured
