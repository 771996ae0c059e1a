"""The MTP draft's host work between forwards launches a fixed number of device ops a step.

Why: that work sits between the target's verify and the next step's launch, so on a GPU each
op it launches is host time the device waits for. Taking each request's draft row with its
own copies (two launches a request: 128 at 64 decoding requests) made it grow with the
batch; one gather a step does not. Ops are counted as torch dispatches them (each is a
kernel launch on a GPU), inside :meth:`Speculation.caught_up`, :meth:`Speculation.draft_extend`
and :meth:`Speculation.finish_step`, for the same workload at two batch sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from dsv32_engine.serving.speculative import Speculation
from tests.serving.test_speculative import LOOP, _model

METHODS = ("caught_up", "draft_extend", "finish_step")


class _Ops(TorchDispatchMode):
    """Counts the ops torch dispatches while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _most_ops(requests: int, mixed: bool) -> dict[str, int]:
    """Per method, the most ops one call dispatched outside the draft's own forwards, over a
    run where ``requests`` requests arrive at once and decode together."""
    most = dict.fromkeys(METHODS, 0)
    calls = dict.fromkeys(METHODS, 0)
    counting: list[_Ops] = []

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Speculation, *args: Any, **kwargs: Any) -> Any:
            ops = _Ops()
            counting.append(ops)
            try:
                with ops:
                    return method(self, *args, **kwargs)
            finally:
                counting.pop()
                most[name] = max(most[name], ops.count)
                calls[name] += 1

        return call

    overrides = {
        **LOOP,
        "loop.requests": requests,
        "planner.max_batch": requests,
        "graphs.sizes": sorted({1, 2, requests}),
        "loop.arrival_rate": 100.0,
        "loop.prompt_len": [4, 8],
        "loop.max_new_tokens": [12, 12],
        "loop.mixed": mixed,
        "speculative.draft": "mtp",
        "speculative.draft_tokens": 3,
    }
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    run = engine.speculation.run

    def forward(*args: Any, **kwargs: Any) -> Any:  # the draft's forward is not host work
        with _Paused(counting):
            return run(*args, **kwargs)

    engine.speculation.run = forward
    with pytest.MonkeyPatch.context() as patch:
        for name in METHODS:
            patch.setattr(Speculation, name, counted(name, getattr(Speculation, name)))
        engine.run(progress=False)
    assert all(calls.values()), calls  # every method ran
    return most


class _Paused:
    """The innermost counting mode off for a while (its forward's ops are not counted)."""

    def __init__(self, counting: list[_Ops]) -> None:
        self.counting = counting

    def __enter__(self) -> None:
        self.saved = self.counting[-1].count

    def __exit__(self, *exc: object) -> None:
        self.counting[-1].count = self.saved


@pytest.mark.parametrize("mixed", [False, True], ids=["apart", "mixed"])
def test_the_drafts_host_work_launches_as_many_ops_at_8_requests_as_at_2(mixed):
    small = _most_ops(2, mixed)
    large = _most_ops(8, mixed)
    assert large == small
