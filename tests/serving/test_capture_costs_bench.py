"""The capture-costs benchmark (``python -m benchmarks capture_costs``): what it reads of a
run's graphs, each case's three runs (a first start, the defaults, decode graphs only) and
their ratios, a failed run kept without losing the others; a fake decode CLI stands in, and
one real tiny run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from benchmarks.loop.capture_costs import CASES, VARIANTS, main, read_capture


def payload(graphs: int, seconds: float, pool: int) -> dict:
    costs = {
        f"{'mixed' if k else 'decode'}/t{k}": {
            "seconds": seconds / graphs,
            "plan_seconds": 0.01,
            "warmup_seconds": 0.1,
            "record_seconds": 0.2,
        }
        for k in range(graphs)
    }
    summary = {
        "graph_capture_costs": costs,
        "graph_capture_seconds": seconds,
        "graph_pool_bytes": pool // 10,
        "graph_pool_reserved_bytes": pool,
        "kv_tokens_capacity": 4096,
    }
    return {"summary": summary, "tokens": {}}


class FakeCli:
    """The decode CLI: the defaults capture 4 graphs in 2 s, decode graphs only 2 in 1 s."""

    def __init__(self, fail: str | None = None):
        self.fail, self.calls = fail, []

    def __call__(self, cmd, timeout):
        self.calls.append(cmd)
        if self.fail and self.fail in cmd:
            return CompletedProcess(cmd, 1, "", "Traceback\nRuntimeError: out of memory")
        decode_only = "graphs.ragged=false" in cmd
        data = payload(2, 1.0, 100) if decode_only else payload(4, 2.0, 150)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(data))
        return CompletedProcess(cmd, 0, "", "")


def test_read_capture_counts_graphs_by_mode_and_sums_phases():
    c = read_capture(payload(3, 1.5, 10))
    assert c["graphs"] == 3 and c["graphs_by_mode"] == {"decode": 1, "mixed": 2}
    assert c["warmup_seconds"] == pytest.approx(0.3) and c["record_seconds"] == pytest.approx(0.6)
    assert (c["capture_seconds"], c["pool_reserved_bytes"], c["kv_tokens"]) == (1.5, 10, 4096)
    assert c["pool_bytes"] == 1


def test_each_case_runs_both_variants_at_start_up_and_reports_ratios(tmp_path, capsys):
    cli = FakeCli()
    assert main(["--cases", "seed", "--out", str(tmp_path)], runner=cli) == 0
    assert len(cli.calls) == len(VARIANTS) == 3
    for cmd in cli.calls:
        assert cmd[cmd.index("--config") + 1] == CASES["seed"][0]
        assert "--max-steps" in cmd and "planner.max_batch=16" in cmd
    # a first start (compiles), then the defaults against decode graphs only
    assert ["graphs.ragged=false" in cmd for cmd in cli.calls] == [False, False, True]
    saved = json.loads((tmp_path / "capture_costs.json").read_text())["cases"]["seed"]
    assert saved["seconds_ratio"] == 2.0 and saved["pool_ratio"] == 1.5
    assert saved["kv_ratio"] == 1.0
    assert "2.00x" in capsys.readouterr().out


def test_a_failed_run_is_reported_and_the_others_still_run(tmp_path, capsys):
    cli = FakeCli(fail="dsv32-small")
    assert main(["--cases", "small", "shapes", "--out", str(tmp_path)], runner=cli) == 1
    assert len(cli.calls) == 6
    saved = json.loads((tmp_path / "capture_costs.json").read_text())["cases"]
    assert saved["small"]["seconds_ratio"] is None and saved["shapes"]["seconds_ratio"] == 2.0
    assert "FAILED (exit 1)" in capsys.readouterr().out


def test_an_unknown_case_is_refused_by_name():
    with pytest.raises(SystemExit):
        main(["--cases", "nope"], runner=FakeCli())


def test_the_tiny_model_on_the_cpu(tmp_path):
    argv = ["--case", "tiny=dsv32-tiny", "--extra=--device cpu", "--out", str(tmp_path)]
    assert main(argv) == 0
    tiny = json.loads((tmp_path / "capture_costs.json").read_text())["cases"]["tiny"]
    for run in tiny["runs"].values():
        assert run["capture"]["graphs"] >= 1 and run["capture"]["record_seconds"] > 0
