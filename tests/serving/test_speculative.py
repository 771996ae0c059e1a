"""Speculative decoding in the loop: greedy speculative decoding emits plain decoding's tokens.

For both drafts (n-gram, and the MTP layer: draft extend and multi-step draft decode) and
2, 3, 4 and 8 tokens per verify, every request's tokens equal non-speculative decoding's,
through the planner and the (emulated) graph runner, at padded batch sizes. The model has
32 index heads: with the tiny preset's 4, index scores tie at exactly 0 and either key may
be kept (DSV32.md), which would make any exact comparison a coin toss.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from benchmarks.loop import spec_decode
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.accept import accept_greedy
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.ngram import NgramDraft
from dsv32_engine.serving.report import summarize
from dsv32_engine.serving.run_config import load_run_config
from tests.support.cli import planner_cli

CFG = DSV32Config.model_validate({**DSV32Config.tiny().model_dump(), "index_n_heads": 32})
LOOP = {
    "loop.requests": 6,
    "loop.prompt_len": [1, 30],
    "loop.max_new_tokens": [2, 20],
    "loop.arrival_rate": 2.0,
    "planner.max_batch": 4,
    "planner.max_context": 128,
    "model.overrides": {"index_n_heads": 32},
    "graphs.sizes": [1, 2, 4],
}


@cache
def _model() -> DSV32Model:
    return DSV32Model(CFG, seed=0, device="cpu", dtype=torch.float32)


def _run(**speculative):
    overrides = {**LOOP, **{f"speculative.{k}": v for k, v in speculative.items()}}
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    return engine, engine.run(progress=False, keep_tokens=True)


@cache
def _plain() -> dict[int, list[int]]:
    return _run()[1].tokens


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
@pytest.mark.parametrize("tokens", [2, 3, 4, 8])
def test_speculative_greedy_tokens_equal_plain_decoding(draft, tokens):
    engine, result = _run(draft=draft, draft_tokens=tokens)
    plain = _plain()
    assert len(result.tokens) == len(plain) == 6
    for rid, want in plain.items():
        assert result.tokens[rid] == want, f"request {rid} ({draft}, {tokens} tokens)"
    summary = summarize(engine, result)
    spec = summary["speculative"]
    assert spec["verify_steps"] == summary["steps_by_mode"]["target_verify"] > 0
    assert spec["mean_accept_length"] > 1.0  # drafts do get accepted: accept lengths vary
    assert summary["eager_fallbacks"] == {}  # every verify replayed a graph
    if draft == "mtp":
        forwards = spec["draft_forwards"]
        assert forwards["draft_extend"] > 0 and forwards["draft_prefill"] > 0
        for runner in engine.speculation.runners.values():
            assert not runner.stats.eager, runner.stats.eager  # draft batches replayed graphs
            assert runner.stats.steps > 0
        assert (forwards.get("draft_decode", 0) > 0) == (tokens > 2)  # k = tokens - 2 steps


def test_accept_keeps_the_agreeing_prefix_and_the_bonus_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([8], [2, 8]) == [2]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_ngram_draft_follows_the_latest_match_and_cycles():
    draft = NgramDraft(1, 3)
    assert draft.propose(0, [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # after "1 2" came "3"
    assert draft.propose(1, [7, 8, 7, 8, 7], 4) == [8, 7, 8, 7]  # the cycle, past its end
    assert draft.propose(2, [4, 5], 2) == [5, 5]  # no match: repeat the last token
    assert draft.propose(3, [40, 1, 2], 2) == [3, 9]  # another request taught "1 2 -> 3"


def test_the_cpu_speculative_config_serves_and_reports(tmp_path):
    """configs/dsv32-tiny-spec.yaml through the CLI (fewer requests): accept length, both
    throughputs, and speculative tokens equal to plain decoding's."""
    out = tmp_path / "summary.json"
    proc = planner_cli(
        "decode",
        "--config",
        "dsv32-tiny-spec",
        "--requests",
        "3",
        "--quiet",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "mean accept length" in proc.stdout and "with / without speculation" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["speculative"]["draft"] == "ngram"
    assert summary["plain"]["tokens_equal"] is True
    assert summary["plain"]["tokens_per_second"] > 0


def test_gpu_benchmark_script_smoke_mode(tmp_path):
    """``python -m benchmarks spec_decode --smoke``: plain, MTP, n-gram and plain again on the
    CPU."""
    assert spec_decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "spec_decode.json").read_text())
    runs = report["runs"]
    assert list(runs) == ["plain", "mtp", "ngram", "plain again"]
    assert runs["mtp"]["draft"] == "mtp" and runs["mtp"]["mean_accept_length"] >= 1.0
    assert all(r["requests_equal_to_plain"] == "2/2" for r in runs.values())  # exact on the CPU
