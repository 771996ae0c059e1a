"""Faults in the decode engine: a CUDA graph capture, or its JIT warm-up, failing for one size.

What must happen: the runner drops that size (its batches pad to the next one, or run
eagerly when it was the largest), says so once, and the engine serves the same tokens as
a graphs-off run. Simulated inside the engine's emulated graph runner.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from dsv32_engine.serving.engine import DecodeEngine
from graphs import SIZE_DROPPED, GraphWarning, is_capturing
from planner import ForwardMode
from tests.support.engines import tiny_engine

SMALL = {
    "loop.requests": 8,
    "loop.prompt_len": [2, 6],
    "loop.max_new_tokens": [4, 20],
    "loop.arrival_rate": 2.0,
    "planner.max_batch": 8,
    "planner.max_context": 128,
    "model.overrides": {"num_hidden_layers": 2},
}
"""Batches of 1..8 on the ladder 1, 2, 4, 8."""


def _engine(**overrides) -> DecodeEngine:
    return tiny_engine(SMALL | overrides)


@pytest.fixture(scope="module")
def eager_tokens():
    """The reference: the same workload with graphs off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        return _engine(**{"graphs.enabled": False}).run(progress=False, keep_tokens=True).tokens


def _fail_capture_of(engine: DecodeEngine, size: int) -> None:
    inner = engine.runner.forward

    def forward(inputs, plans):
        if is_capturing() and plans.reqs == size:
            raise RuntimeError("CUDA error: out of memory (simulated, during capture)")
        return inner(inputs, plans)

    engine.runner.forward = forward


def _fail_first_warmup(engine: DecodeEngine, monkeypatch) -> None:
    """The schedule provider's warm-up hook fails, as a deep_gemm JIT compile would."""

    def warmup(*args):
        raise RuntimeError("deep_gemm JIT: failed to compile paged_mqa_logits_metadata (simulated)")

    for step in engine.planner.program(ForwardMode.DECODE).steps:
        if step.op_name == "paged_mqa_schedule":
            monkeypatch.setattr(step.chain, "current", replace(step.provider, warmup=warmup))


def test_capture_failure_drops_one_size_and_serves_identical_tokens(eager_tokens):
    engine = _engine(**{"planner.debug": True})  # every replay re-planned eagerly and compared
    _fail_capture_of(engine, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False, keep_tokens=True)
    said = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    assert len(said) == 1 and "batch size 4 failed and was dropped" in said[0]
    stats = engine.runner.stats
    assert stats.captured["decode"] == [1, 2, 8] and list(stats.dropped["decode"]) == [4]
    assert stats.eager == {}  # batches of 3 and 4 pad to 8 instead
    assert stats.replays[("decode", 8)] > 0 and stats.replays[("decode", 4)] == 0
    assert engine.planner.stats.verified == result.decode_steps
    assert result.tokens == eager_tokens


def test_failed_warmup_drops_the_largest_size_runs_it_eagerly_and_says_so_once(
    eager_tokens, monkeypatch
):
    engine = _engine(**{"planner.debug": True})
    _fail_first_warmup(engine, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False, keep_tokens=True)
    said = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    assert len(said) == 2, said  # the drop, then the first eager fallback; never per step
    assert "batch size 8 failed" in said[0] and "JIT" in said[0] and SIZE_DROPPED in said[1]
    stats = engine.runner.stats
    assert list(stats.dropped["decode"]) == [8] and stats.captured["decode"] == [1, 2, 4]
    assert stats.eager[SIZE_DROPPED] > 1 and stats.graph_steps > 0
    assert result.tokens == eager_tokens
