"""The decode loop's chunked prefill: prompt tokens per step, steps per request, the summary."""

from __future__ import annotations

import json
import math

import pytest

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from tests.support.cli import planner_cli


@pytest.mark.parametrize("chunk", [5, 16, 256])
def test_each_prompt_takes_ceil_of_its_length_over_the_budget_in_prefill_steps(chunk):
    engine = DecodeEngine(load_run_config(None, {"loop.requests": 12, "loop.chunk_tokens": chunk}))
    finished = []  # the scheduler keeps no finished request: collect them as they finish
    finish = engine.scheduler.finish
    engine.scheduler.finish = lambda request, step: (
        finished.append(request),
        finish(request, step),
    )
    result = engine.run(progress=False)
    assert engine.scheduler.finished_count == result.finished == 12
    assert len(finished) == 12 and result.prefill_tokens == sum(len(r.prompt) for r in finished)
    for request in finished:
        assert request.prefill_steps == math.ceil(len(request.prompt) / chunk), request.rid
    assert len(result.ttft_seconds) == 12 and all(t > 0 for t in result.ttft_seconds)
    assert result.steps_by_mode["extend"] == result.prefill_steps


def test_the_cli_default_run_reports_prefill_decode_and_ttft(tmp_path):
    out = tmp_path / "summary.json"
    run = planner_cli("decode", "--quiet", "--json", str(out), timeout=300)
    assert run.returncode == 0, run.stderr
    for line in ("prefill tokens/s", "decode tokens/s", "time to first token", "forwards by mode"):
        assert line in run.stdout, line
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests_finished"] == 32
    assert summary["prefill_tokens"] > 0 and summary["decode_tokens"] > 0
    assert summary["ttft_ms_p50"] > 0 and summary["ttft_ms_p99"] >= summary["ttft_ms_p50"]
    assert summary["steps_by_mode"]["extend"] >= 1 and summary["steps_by_mode"]["decode"] >= 1
    assert summary["eager_fallbacks"] == {}
