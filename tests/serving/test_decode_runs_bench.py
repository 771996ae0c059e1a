"""The decode-runs benchmark (``python -m benchmarks decode_runs``): its cases, what it keeps of
a run, the table and JSON of all, and a failing run reported without losing the others. A fake
runner stands in for the decode CLI, and one real run of the tiny model on the CPU, so the
script the GPU session calls cannot rot between sessions. (That its cases' configs load with
their arguments is ``tests/test_gpu_scripts.py``'s check.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from benchmarks.loop.decode_runs import CASES, DEFAULT, OFF, case_names, main, read_summary


def payload(tps=100.0, *, fallbacks=None):
    summary = {
        "tokens_per_second": tps,
        "step_ms_p50": 2.0,
        "step_ms_p99": 3.0,
        "ttft_ms_p50": 5.0,
        "graph_replays": 40,
        "ragged_replays": 3,
        "eager_fallbacks": {"decode:bs=300": 2, "extend": 1} if fallbacks is None else fallbacks,
        "requests_finished": 4,
        "interrupted": False,
    }
    return {"summary": summary, "tokens": {0: [1, 2]}}


class FakeCli:
    """Writes a run's ``--json`` file like the decode CLI; configs in ``fail`` exit 1."""

    def __init__(self, fail=()):
        self.fail, self.calls = set(fail), []

    def __call__(self, cmd, timeout):
        self.calls.append(cmd)
        config = cmd[cmd.index("--config") + 1]
        if config in self.fail:
            return CompletedProcess(cmd, 1, "", "Traceback\nConfigError: refused")
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(payload()))
        return CompletedProcess(cmd, 0, "", "")


def test_case_names_take_commas_groups_and_each_case_once():
    assert case_names(["small,shapes", "arrivals", "small"]) == [
        "small", "shapes", "arrivals_off", "arrivals_on",
    ]  # fmt: skip
    assert case_names([]) == [] and set(DEFAULT) <= set(CASES)


def test_read_summary_keeps_the_metrics_and_sums_counts_by_kind():
    run = read_summary(payload())
    assert run["tokens_per_second"] == 100.0 and run["ttft_ms_p50"] == 5.0
    assert (run["graph_replays"], run["ragged_replays"], run["eager_fallbacks"]) == (40, 3, 3)
    assert "tokens" not in run and read_summary(payload(fallbacks={}))["eager_fallbacks"] == 0
    assert run["mean_accept_length"] is None and run["spec_equals_plain"] is None  # no draft
    spec = payload()
    spec["summary"]["speculative"] = {"mean_accept_length": 2.5, "mixed_verify_steps": 7}
    spec["summary"]["plain"] = {"tokens_equal": True}
    run = read_summary(spec)
    assert (run["mean_accept_length"], run["mixed_verify_steps"]) == (2.5, 7)
    assert run["spec_equals_plain"] is True


def test_the_mtp_cases_compare_mixing_against_the_same_draft_apart():
    """Issue 55's speculative pair: one draft, the same config, only ``loop.mixed`` apart; the
    same draft under the defaults before issue 55 (no ragged graphs, no mixing); and the
    batch-invariant mixed run that compares its tokens with plain greedy's."""
    assert case_names(["arrivals_mtp"]) == [
        "arrivals_mtp_off",
        "arrivals_mtp_apart",
        "arrivals_mtp_mixed",
    ]
    off_config, off = CASES["arrivals_mtp_off"]
    assert off_config == "dsv32-small-arrivals" and off == ["--draft", "mtp", *OFF]
    (apart_config, apart), (mixed_config, mixed) = (
        CASES["arrivals_mtp_apart"],
        CASES["arrivals_mtp_mixed"],
    )
    assert apart_config == mixed_config == "dsv32-small-arrivals"
    assert apart[-1] == "loop.mixed=false" and mixed[-1] == "loop.mixed=true"
    assert apart[:-1] == mixed[:-1] and "mtp" in apart
    invariant = CASES["arrivals_mtp_invariant"][1]
    assert invariant[: len(mixed)] == mixed
    assert "--batch-invariant" in invariant and "--compare-plain" in invariant
    wide = CASES["arrivals_mtp_wide"][1]  # the mixed run, its budget 512 + 64 x 4 verify rows
    assert wide[: len(mixed)] == mixed and wide[len(mixed) :] == ["--set", "loop.chunk_tokens=768"]


def test_main_runs_each_case_once_into_out_and_writes_all(tmp_path, capsys):
    cli = FakeCli()
    argv = ["--cases", "small,arrivals_debug", "--extra=--device cpu", "--out", str(tmp_path)]
    assert main(argv, runner=cli) == 0
    assert [cmd[:6] for cmd in cli.calls] == [
        [sys.executable, "-m", "planner", "decode", "--config", CASES[name][0]]
        for name in ("small", "arrivals_debug")
    ]
    debug = cli.calls[1]
    assert debug[6:9] == ["--quiet", "--json", str(tmp_path / "arrivals_debug.json")]
    assert debug[9:] == [*CASES["arrivals_debug"][1], "--device", "cpu"]
    saved = json.loads((tmp_path / "decode_runs.json").read_text())
    assert list(saved["cases"]) == ["small", "arrivals_debug"]
    assert saved["cases"]["small"]["summary"]["eager_fallbacks"] == 3
    assert (tmp_path / "small.json").exists()  # each run's own file beside the summary
    out = capsys.readouterr().out
    assert "decode runs" in out and "arrivals_debug" in out


def test_a_failed_run_is_reported_and_the_others_still_run(tmp_path, capsys):
    cli = FakeCli(fail={"dsv32-small"})
    argv = ["--cases", "small", "shapes", "--out", str(tmp_path)]
    assert main(argv, runner=cli) == 1
    assert len(cli.calls) == 2
    captured = capsys.readouterr()
    assert "ConfigError: refused" in captured.err and "FAILED (exit 1)" in captured.out
    cases = json.loads((tmp_path / "decode_runs.json").read_text())["cases"]
    assert cases["small"]["failure"]["exit"] == 1 and cases["small"]["summary"] is None
    assert cases["shapes"]["failure"] is None


def test_an_unknown_case_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--cases", "smal"], runner=FakeCli())
    assert "unknown cases ['smal']" in capsys.readouterr().err


def test_a_real_run_of_the_tiny_model_on_the_cpu(tmp_path):
    argv = ["--case", "tiny=dsv32-tiny:--requests 2", "--extra=--device cpu"]
    assert main([*argv, "--timeout", "300", "--out", str(tmp_path)]) == 0
    (name, case), *_ = json.loads((tmp_path / "decode_runs.json").read_text())["cases"].items()
    summary = case["summary"]
    assert name == "tiny" and case["failure"] is None
    assert summary["requests_finished"] == 2 and summary["tokens_per_second"] > 0
    assert summary["graph_replays"] > 0 and summary["eager_fallbacks"] == 0
