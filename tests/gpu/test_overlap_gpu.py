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
