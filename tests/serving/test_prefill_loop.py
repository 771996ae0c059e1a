"""The decode loop's chunked prefill: prompt tokens per step, steps per request, the summary."""

from __future__ import annotations

import json

import pytest

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from tests.support.cli import planner_cli


@pytest.mark.parametrize(
    ("chunk", "mixed"), [(5, False), (16, False), (256, False), (16, True), (40, True)]
)
def test_each_step_fills_its_token_budget_with_prompt_chunks_in_admission_order(chunk, mixed):
    """A step's tokens are at most ``loop.chunk_tokens``, decode rows included where they mix,
    and the prompts waiting take all the budget leaves (a chunk is cut to fit it), first
    admitted first; every prompt token is fed once."""
    config = {"loop.requests": 12, "loop.chunk_tokens": chunk, "loop.mixed": mixed}
    engine = DecodeEngine(load_run_config(None, config))
    steps = []
    step_work = engine._step_work

    def spy():
        running = engine.scheduler.running
        waiting = [len(r.prompt) - r.fed for r in running if r.prefilling]
        decoding = sum(not r.prefilling and not r.spent for r in running)
        work, mode, apart = step_work()
        prompt = [n for r, n in work if r.prefilling]
        steps.append((sum(n for _, n in work), waiting, decoding if mixed else 0, prompt))
        return work, mode, apart

    engine._step_work = spy
    result = engine.run(progress=False)
    assert result.finished == 12
    for tokens, waiting, decoding, prompt in steps:
        room = max(chunk - decoding, 0)
        assert tokens <= max(chunk, decoding)  # decodes alone run apart past the budget
        assert sum(prompt) == min(room, sum(waiting))  # the budget's room, all of it
        # admission order: each request's whole remainder before the next one's first token
        assert prompt[:-1] == waiting[: len(prompt) - 1]
    assert result.prefill_tokens == sum(sum(p) for *_, p in steps)
    assert len(result.ttft_seconds) == 12 and all(t > 0 for t in result.ttft_seconds)
    assert result.steps_by_mode.get("mixed" if mixed else "extend") == result.prefill_steps


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
