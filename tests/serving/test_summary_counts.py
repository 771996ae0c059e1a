"""The summary counts what it says it counts: loop steps beside the forwards they ran, every
generated token (a loop cut short included), replays of every runner (the draft's too) the
same on a rank's line and in the aggregate, the checks debug mode made; and ``--no-graphs``
runs eagerly without a warning about what was asked for."""

from __future__ import annotations

import io
import json
import warnings

import pytest
from rich.console import Console

from dsv32_engine.serving.cli import main
from dsv32_engine.serving.report import render, summarize
from graphs import GraphWarning
from tests.support.engines import SMALL_LOOP, tiny_engine


def _table(summary: dict) -> str:
    out = io.StringIO()
    render(summary, Console(file=out, width=200))
    return out.getvalue()


def _row(table: str, label: str) -> str:
    """The value cell of the row whose label starts with ``label``."""
    line = next(line for line in table.splitlines() if line.startswith(f"│ {label}"))
    return line.split("│")[2].strip()


def test_a_loop_cut_by_max_steps_counts_its_steps_and_every_token():
    """``--max-steps 3``: three loop steps, said beside the forwards they ran (a step runs
    prompt chunks and decodes apart: one forward or two), and the tokens of the requests
    still running count as generated."""
    engine = tiny_engine(SMALL_LOOP, share_model=True)
    result = engine.run(progress=False, max_steps=3, keep_tokens=True)
    summary = summarize(engine, result)
    running = engine.scheduler.running
    assert running, "the cut must leave requests unfinished for this test to mean anything"
    kept = sum(len(tokens) for tokens in result.tokens.values())
    assert summary["generated_tokens"] == kept + sum(len(r.generated) for r in running)
    assert summary["generated_tokens"] > summary["decode_tokens"] > 0  # first tokens too
    assert summary["loop_steps"] == 3  # forwards: one or two a step
    assert sum(summary["steps_by_mode"].values()) == result.decode_steps + result.prefill_steps
    assert summary["requests_unfinished"] == 6 - summary["requests_finished"] > 0
    assert not summary["interrupted"]
    table = _table(summary)
    forwards = ", ".join(f"{k} {v}" for k, v in summary["steps_by_mode"].items())
    assert _row(table, "loop steps (forwards by mode)") == f"3 ({forwards})"
    assert _row(table, "generated tokens") == str(summary["generated_tokens"])


def test_a_whole_run_counts_the_tokens_of_its_finished_requests():
    engine = tiny_engine(SMALL_LOOP, share_model=True)
    result = engine.run(progress=False, keep_tokens=True)
    summary = summarize(engine, result)
    assert summary["requests_unfinished"] == 0 and summary["requests_finished"] == 6
    assert summary["generated_tokens"] == sum(len(t) for t in result.tokens.values())
    assert "unfinished" not in _row(_table(summary), "requests finished")


def test_a_stop_request_ends_the_loop_between_steps():
    """``stop`` (Ctrl-C's request) is read before every step: the loop ends there, marked."""
    engine = tiny_engine(SMALL_LOOP, share_model=True)
    asked = iter([False, False, True])
    result = engine.run(progress=False, stop=lambda: next(asked))
    summary = summarize(engine, result)
    assert result.interrupted and summary["interrupted"] and summary["loop_steps"] == 2
    assert "INTERRUPTED (Ctrl-C) after 2 loop steps" in " ".join(_table(summary).split())


def test_debug_mode_reports_the_checks_it_made(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["decode", "--quiet", "--debug", "--requests", "3", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["debug"] is True
    assert summary["verified_replays"] == summary["graph_replays"] > 0  # every replay
    # the prompt chunks ran eagerly (ragged graphs are off by default): each digested
    assert summary["plan_write_checks"] == summary["steps_by_mode"]["extend"] > 0
    row = _row(capsys.readouterr().out, "debug checks")
    assert row.startswith(f"{summary['verified_replays']} of {summary['graph_replays']}")

    assert main(["decode", "--quiet", "--requests", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["debug"] is False and summary["verified_replays"] is None
    assert summary["plan_write_checks"] is None  # nothing checked: not zero checks passed
    assert "debug checks" not in capsys.readouterr().out


def test_graph_replays_count_the_drafts_graphs_too():
    """Under an MTP draft, "graph replays" is every runner's: the target's verify graphs and
    the draft's extend and decode graphs (what a rank's line and the aggregate report)."""
    overrides = {**SMALL_LOOP, "speculative.draft": "mtp", "speculative.draft_tokens": 3}
    engine = tiny_engine(overrides)
    summary = summarize(engine, engine.run(progress=False))
    draft = summary["speculative"]["draft_graph_replays"]
    assert min(draft.values()) > 0
    assert summary["graph_replays"] == engine.runner.stats.graph_steps + sum(draft.values())


@pytest.mark.parametrize("how", [["--no-graphs"], ["--set", "graphs.enabled=false"]])
def test_graphs_off_runs_eagerly_without_a_warning(how, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["decode", "--quiet", "--requests", "2", *how]) == 0
    assert not [w for w in caught if issubclass(w.category, GraphWarning)]
    out = capsys.readouterr().out
    assert "graph replays (off)" in out and "graphs off: every step eager" in out
