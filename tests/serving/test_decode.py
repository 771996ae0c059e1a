"""DeepSeek-V3.2 decode through the planner loop: graphs, reloads and verify change no token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv32_engine.serving.report import summarize
from planner import ConfigError
from tests.support import REPO
from tests.support.cli import planner_cli
from tests.support.engines import SMALL_LOOP as SMALL
from tests.support.engines import tiny_engine


def _run(**overrides):
    engine = tiny_engine({**SMALL, **overrides})
    result = engine.run(progress=False, keep_tokens=True)
    return engine, result


@pytest.fixture(scope="module")
def with_graphs():
    return _run()


def test_every_request_finishes_with_its_budget(with_graphs):
    engine, result = with_graphs
    assert len(result.tokens) == 6
    summary = summarize(engine, result)
    # decode steps replay; prompt chunks run eagerly (ragged graphs are off by default)
    assert summary["graph_replays"] == result.decode_steps > 0
    assert engine.runner.stats.ragged["extend"] == result.prefill_steps > 0
    assert not engine.runner.stats.eager
    assert summary["schedule_calls_per_step"] == pytest.approx(1.0)
    assert summary["sparse_mla_kernel"] == "torch"  # the CPU: the exact reference
    assert not engine.scheduler.running and engine.cache.num_used_pages == 0


def test_greedy_tokens_identical_without_graphs(with_graphs):
    _, result = with_graphs
    _, eager = _run(**{"graphs.enabled": False})
    assert eager.tokens == result.tokens


def test_greedy_tokens_identical_with_prompt_chunks_replayed(with_graphs):
    """Ragged graphs on: prompt chunks replay token buckets too, nothing eager; same tokens."""
    _, result = with_graphs
    engine, replayed = _run(**{"graphs.ragged": True})
    assert replayed.tokens == result.tokens
    stats = engine.runner.stats
    assert stats.graph_steps == replayed.decode_steps + replayed.prefill_steps
    assert not stats.eager and not stats.ragged and replayed.prefill_steps > 0


def test_greedy_tokens_identical_with_the_staging_copy_outside_the_graph(with_graphs):
    """The default (auto) stages in the graph: the graphs pulled every replayed step."""
    engine, result = with_graphs
    assert engine.planner.staging == "graph"
    rings = {id(c.stager): c.stager.transport.ring for c in engine.planner._captured.values()}
    pulls = sum(ring.seq for ring in rings.values())
    assert pulls == summarize(engine, result)["graph_replays"] > 0
    assert summarize(engine, result)["staging"] == "graph"
    copier, copied = _run(**{"planner.staging_in_graph": False})
    assert copied.tokens == result.tokens
    assert summarize(copier, copied)["staging"] == "copy"


def test_greedy_tokens_identical_after_save_and_reload(with_graphs, tmp_path):
    engine, result = with_graphs
    path = tmp_path / "tiny.safetensors"
    engine.model.save(path)
    _, reloaded = _run(**{"model.weights": str(path), "model.seed": 123})
    assert reloaded.tokens == result.tokens


def test_speculative_verify_runs_and_counts_drafts(with_graphs):
    engine, result = _run(**{"speculative.draft": "ngram", "speculative.draft_tokens": 2})
    assert len(result.tokens) == 6
    assert engine.runner.stats.summary()["captured"].get("target_verify")
    assert all(len(t) > 0 for t in result.tokens.values())
    assert summarize(engine, result)["speculative"]["verify_steps"] == result.decode_steps


def test_debug_mode_verifies_every_replay():
    engine, result = _run(**{"planner.debug": True, "loop.requests": 3})
    assert engine.planner.stats.verified == result.decode_steps > 0
    ragged, replayed = _run(**{"planner.debug": True, "loop.requests": 3, "graphs.ragged": True})
    assert ragged.planner.stats.verified == replayed.decode_steps + replayed.prefill_steps
    assert replayed.prefill_steps > 0  # ragged replays are verified too


def test_set_overrides_any_config_key_and_flags_win(tmp_path):
    out = tmp_path / "summary.json"
    proc = planner_cli(
        "decode", "--set", "loop.requests=9", "--set", "loop.mixed=true", "--requests", "4",
        "--set", "loop.arrival_rate=0.5", "--set", "graphs.ragged=false",
        "--quiet", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["summary"]["requests_finished"] == 4  # --requests wins over --set
    # mixed steps ran, and eagerly: ragged graphs were set off
    assert data["summary"]["steps_by_mode"].get("mixed", 0) > 0
    assert data["summary"]["ragged_steps"].get("mixed", 0) > 0


def test_cli_prints_the_summary(tmp_path):
    out = tmp_path / "summary.json"
    proc = planner_cli("decode", "--requests", "3", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "schedule computations per step" in proc.stdout
    data = json.loads(out.read_text())
    assert data["summary"]["requests_finished"] == 3
    assert data["summary"]["staging"] == "graph"
    proc = planner_cli("decode", "--requests", "2", "--staging", "copy", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "a copy before each launch" in proc.stdout
    assert json.loads(out.read_text())["summary"]["staging"] == "copy"


def test_cli_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner:\n  max_batch: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "planner", "decode", "--config", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert "planner.max_batch" in proc.stderr and "Traceback" not in proc.stderr


def test_the_engine_gives_the_planner_its_kv_slots():
    """out_cache_loc and the token table are range-checked against the cache the engine has."""
    engine = tiny_engine(SMALL)
    assert engine.planner.limits.kv_slots == engine.cache.num_slots > 0


def test_tokens_are_kept_only_when_asked(with_graphs):
    engine, kept = with_graphs
    result = tiny_engine(SMALL).run(progress=False)
    assert result.tokens == {} and result.finished == len(kept.tokens) == 6
    assert result.generated_tokens == sum(len(t) for t in kept.tokens.values())
    assert summarize(engine, result)["generated_tokens"] == result.generated_tokens


def test_no_schedule_figure_without_a_decode_step():
    engine = tiny_engine(SMALL)
    result = engine.run(progress=False, max_steps=1)  # the first step only prefills
    assert result.decode_steps == 0
    assert summarize(engine, result)["schedule_calls_per_step"] is None


@pytest.mark.parametrize("steps", [0, -1, True])
def test_max_steps_below_one_is_refused(steps):
    with pytest.raises(ConfigError) as info:
        tiny_engine(SMALL).run(progress=False, max_steps=steps)
    assert info.value.field == "max_steps"
