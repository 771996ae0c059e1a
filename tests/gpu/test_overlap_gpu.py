"""The loop one step ahead on the GPU: dsv32-small in bf16 under CUDA graphs, where step N+1
really is launched while step N runs. Greedy tokens must equal the synchronous loop's for
every request (the batches are the same step for step), and debug mode's race checks (each
decode row's id, taken on the device, is the token the host reads later; every replay
equal to eager) must pass while the host runs ahead."""

from __future__ import annotations

import pytest
import torch

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from tests.support import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SMALL = REPO / "configs" / "dsv32-small.yaml"
LOOP = {
    "loop.requests": 12,
    "loop.arrival_rate": 2.0,
    "loop.prompt_len": [16, 200],
    "loop.max_new_tokens": [8, 40],
    "loop.chunk_tokens": 256,
    "planner.max_batch": 8,
    "planner.max_context": 512,
}
VARIANTS = {
    "decode": {},
    "ragged graphs, mixed": {
        "graphs.ragged": True,
        "loop.mixed": True,
        "planner.ragged_kv_tokens": 16384,
    },
}


def _tokens(overlap: bool, debug: bool = False, **overrides) -> tuple[DecodeEngine, dict]:
    values = {**LOOP, **overrides, "loop.overlap": overlap, "planner.debug": debug}
    engine = DecodeEngine(load_run_config(SMALL, values))
    result = engine.run(progress=False, keep_tokens=True)
    assert result.finished == LOOP["loop.requests"]
    return engine, result


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_step_ahead_decodes_the_synchronous_tokens_on_the_gpu(variant):
    _, sync = _tokens(False, **VARIANTS[variant])
    engine, ahead = _tokens(True, **VARIANTS[variant])
    assert engine.overlap
    assert ahead.tokens == sync.tokens
    assert ahead.steps_by_mode == sync.steps_by_mode
    _, checked = _tokens(True, debug=True, **VARIANTS[variant])
    assert checked.tokens == sync.tokens


def test_a_second_engine_in_one_process_captures_every_graph():
    """Each runner captures on a side stream of its own: its warm-up runs there too, or the
    stream's first GEMM (cuBLAS's per-stream handle and workspace) comes inside a capture,
    which dropped a mixed graph of the second engine of a process."""
    values = {**LOOP, **VARIANTS["ragged graphs, mixed"]}
    for overlap in (False, True):
        engine = DecodeEngine(load_run_config(SMALL, {**values, "loop.overlap": overlap}))
        engine.warm_up()
        assert engine.runner.stats.dropped == {}
        del engine


class NoSyncWindow:
    """A ``run(busy=...)`` meter that turns CUDA's sync debug mode to ``error`` once every
    request decodes (no arrival, admission or prompt chunk left: those plan eagerly and read
    their checks at once), and off at the end: from then on any call that makes the host
    wait for the device (``.item()``, ``.tolist()`` of a CUDA tensor, a blocking copy, a
    stream or device synchronize) raises. Waiting on a step's own event (``PendingRead``)
    is not such a call: it is the one wait the loop one step ahead makes."""

    def __init__(self, engine: DecodeEngine, requests: int) -> None:
        self.engine, self.requests, self.steps = engine, requests, 0

    def at_step(self, step: int) -> None:
        sched = self.engine.scheduler
        decoding = not sched.waiting and all(not r.prefilling for r in sched.running)
        if self.steps == 0 and decoding and sched.finished_count == 0 and step >= 2:
            torch.cuda.set_sync_debug_mode("error")
        if torch.cuda.get_sync_debug_mode():
            self.steps += 1

    def loop_step(self, step: int, seconds: float) -> None:
        pass

    def finish(self, step: int) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def summary(self) -> None:
        return None


def test_the_loop_ahead_never_waits_for_the_device_while_it_decodes():
    """Every request arrives at step 0 and prefills in one chunk; from then on, decode steps
    replayed one step ahead make no synchronising call at all."""
    values = {
        **LOOP,
        "loop.requests": 8,
        "loop.arrival_rate": 1000.0,
        "loop.prompt_len": [16, 64],
        "loop.max_new_tokens": [40, 80],
        "loop.overlap": True,
    }
    engine = DecodeEngine(load_run_config(SMALL, values))
    window = NoSyncWindow(engine, 8)
    try:
        result = engine.run(progress=False, keep_tokens=True, busy=window)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result.finished == 8
    assert window.steps >= 30, window.steps
