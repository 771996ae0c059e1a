"""A loop step's host work outside its forwards launches a fixed number of ops, whatever the batch.

Why: that work sits between one forward and the next launch (a speculating loop's between the
verify's read and the next step), so on a GPU each op it launches is host time the device may
wait for. The MTP draft once took each request's starting row with its own copies, two
launches a request (128 at 64 decoding requests); one gather a draft forward does not grow.
Ops are counted as torch dispatches them (each a kernel launch or copy on a GPU) inside
:meth:`DecodeEngine.step`, for the same workload at two batch sizes: the most any step
dispatched must be equal. Not counted: every forward through a graph runner (target and
draft), and admitting and releasing a request (a token-table row written or zeroed per
request that arrives or finishes, not per request that runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from dsv32_engine.serving.scheduler import Scheduler
from graphs import GraphRunner
from tests.serving.test_speculative import LOOP, _model


class _Ops(TorchDispatchMode):
    """Counts the ops torch dispatches while it is on, but inside a forward (``paused``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.paused
        return func(*args, **(kwargs or {}))


CASES = {
    "plain_ahead": {"loop.overlap": True},
    "plain_synchronous": {"loop.overlap": False},
    "mtp_apart": {"speculative.draft": "mtp", "loop.mixed": False},
    "mtp_mixed": {"speculative.draft": "mtp", "loop.mixed": True},
}


def _most_ops(requests: int, case: dict[str, Any]) -> int:
    """The most ops one loop step dispatched outside its forwards, over a run where
    ``requests`` requests arrive at once, prefill and decode together."""
    overrides = {
        **LOOP,
        "loop.requests": requests,
        "planner.max_batch": requests,
        "graphs.sizes": sorted({1, 2, requests}),
        "loop.arrival_rate": 100.0,
        "loop.prompt_len": [4, 8],
        "loop.max_new_tokens": [12, 12],
        "speculative.draft_tokens": 3,
        **case,
    }
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    ops = _Ops()  # counts only while a step holds it on, and not while it is paused
    most = 0
    step = DecodeEngine.step

    def paused(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            ops.paused += 1
            try:
                return method(*args, **kwargs)
            finally:
                ops.paused -= 1

        return call

    def counted(self: DecodeEngine, *args: Any, **kwargs: Any) -> Any:
        nonlocal most
        ops.count = 0
        try:
            with ops:
                return step(self, *args, **kwargs)
        finally:
            most = max(most, ops.count)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GraphRunner, "step", paused(GraphRunner.step))
        patch.setattr(Scheduler, "admit", paused(Scheduler.admit))
        patch.setattr(Scheduler, "release", paused(Scheduler.release))
        patch.setattr(DecodeEngine, "step", counted)
        engine.run(progress=False)
    assert most > 0
    return most


@pytest.mark.parametrize("case", list(CASES))
def test_a_loop_step_launches_as_many_ops_outside_its_forwards_at_8_requests_as_at_2(case):
    assert _most_ops(8, CASES[case]) == _most_ops(2, CASES[case])
