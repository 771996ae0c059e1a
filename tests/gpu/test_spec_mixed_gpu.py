"""Speculation mixed with prompt chunks on the GPU: dsv32-small in bf16 under real CUDA graphs,
the MTP draft's catch-up captured inside the target's prompt-chunk and mixed graphs. In the
batch-invariant mode every request's speculative tokens must equal plain greedy decoding's,
no graph may be dropped at capture (the target's, the draft extend's, the draft decode's),
and the mixed steps must replay their token buckets; debug mode (every replay checked
against a fresh plan) must pass too."""

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
    "loop.arrival_rate": 0.5,  # arrivals while others decode: verify rows beside chunks
    "loop.prompt_len": [16, 200],
    "loop.max_new_tokens": [8, 40],
    "loop.chunk_tokens": 256,
    "planner.max_batch": 8,
    "planner.max_context": 512,
    "planner.batch_invariant": True,
    "graphs.ragged": True,
    "loop.mixed": True,
}


def _serve(**overrides) -> tuple[DecodeEngine, dict]:
    engine = DecodeEngine(load_run_config(SMALL, {**LOOP, **overrides}))
    result = engine.run(progress=False, keep_tokens=True)
    assert result.finished == LOOP["loop.requests"]
    return engine, result


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_mtp_speculation_mixed_under_graphs_decodes_plain_greedy_tokens(debug):
    _, plain = _serve()
    engine, spec = _serve(**{"speculative.draft": "mtp", "planner.debug": debug})
    assert spec.tokens == plain.tokens
    runners = [engine.runner, *engine.speculation.runners.values()]
    assert all(r.stats.dropped == {} for r in runners)
    stats = engine.runner.stats
    assert not stats.eager and engine.speculation.stats.mixed_verify_steps > 0
    assert any(mode == "mixed" for mode, _ in stats.replays)
