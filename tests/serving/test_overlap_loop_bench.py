"""The overlapped-loop benchmark's plumbing on fabricated runs: what it reads of a run's
``--json`` file, the medians and speed-up per case, the token check that fails the script, and
a failing run reported without losing the other cases. A fake runner stands in for the decode
CLI, so the script the GPU session calls cannot rot between sessions."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import yaml

from benchmarks.loop.overlap_loop import (
    CASES,
    command,
    compare_case,
    differing_requests,
    main,
    parse_case,
    read_run,
    table_rows,
)
from dsv32_engine.serving.run_config import load_run_config


def payload(tps=100.0, *, overlap=True, reason="", busy=0.9, tokens=None):
    summary = {
        "overlap": overlap,
        "overlap_reason": reason,
        "tokens_per_second": tps,
        "ttft_ms_p50": 5.0,
        "ttft_ms_p99": 9.0,
        "step_ms_p50": 2.0,
        "step_ms_p99": 3.0,
        "loop_step_ms_p50": 2.5,
        "loop_step_ms_p99": 4.0,
        "gpu_busy": None if busy is None else {"window_steps": 10, "fraction": busy},
        "generated_tokens": 6,
        "interrupted": False,
    }
    return {
        "summary": summary,
        "tokens": {0: [1, 2, 3], 1: [4, 5, 6]} if tokens is None else tokens,
    }


def test_read_run_keeps_the_metrics_busy_fraction_and_tokens():
    run = read_run(payload(busy=0.75))
    assert run["tokens_per_second"] == 100.0 and run["loop_step_ms_p50"] == 2.5
    assert run["gpu_busy"] == 0.75 and run["gpu_busy_window"]["window_steps"] == 10
    assert run["tokens"] == {"0": [1, 2, 3], "1": [4, 5, 6]}  # the JSON's string keys
    quiet = read_run({"summary": {"tokens_per_second": 1.0, "gpu_busy": None}})
    assert quiet["gpu_busy"] is None and quiet["tokens"] is None and quiet["step_ms_p50"] is None


def test_compare_case_takes_medians_speedup_and_checks_tokens():
    runs = {
        "overlap": [read_run(payload(tps)) for tps in (150.0, 130.0)],
        "no-overlap": [read_run(payload(tps, overlap=False, busy=None)) for tps in (90.0, 110.0)],
    }
    result = compare_case(runs)
    assert result["overlap"]["tokens_per_second"] == 140.0
    assert result["no-overlap"]["gpu_busy"] is None
    assert result["speedup"] == pytest.approx(140.0 / 100.0)
    assert result["overlap"]["overlap"] is True and result["no-overlap"]["overlap"] is False
    assert result["tokens_equal"] is True and result["differing_requests"] == []

    runs["overlap"][1]["tokens"] = {"0": [1, 2, 3], "1": [4, 5, 7], "10": [1]}
    result = compare_case(runs)
    assert result["tokens_equal"] is False and result["differing_requests"] == ["1", "10"]
    rows = table_rows({"c": result})
    assert [row[1] for row in rows] == ["overlap", "no-overlap"]
    assert rows[0][-2] == "NO (2)" and rows[1][-2] == ""


def test_overlap_refused_shows_its_reason_and_no_tokens_is_no_verdict():
    refused = read_run(payload(overlap=False, reason="speculative decoding", tokens={}))
    refused["tokens"] = None
    result = compare_case({"overlap": [refused], "no-overlap": []})
    assert result["tokens_equal"] is None and result["speedup"] is None
    row = table_rows({"c": result})[0]
    assert row[-1] == "off (speculative decoding)" and row[-2] == "n/a"


def test_differing_requests_counts_a_missing_request():
    assert differing_requests({"0": [1], "2": [2]}, {"0": [1]}) == ["2"]


def test_cases_and_command_lines():
    assert parse_case("t=dsv32-tiny:--requests 4 --set a.b=1") == (
        "t",
        ("dsv32-tiny", ["--requests", "4", "--set", "a.b=1"]),
    )
    assert parse_case("t=dsv32-tiny") == ("t", ("dsv32-tiny", []))
    cmd = command("dsv32-small", ["--requests", "16"], "no-overlap", Path("r.json"), 100, ["-x"])
    assert cmd[:5] == [sys.executable, "-m", "planner", "decode", "--config"]
    assert cmd[5:] == ["dsv32-small", "--quiet", "--json", "r.json", "--no-overlap"] + [
        "--gpu-busy", "100", "--requests", "16", "-x",
    ]  # fmt: skip
    assert "--gpu-busy" not in command("c", [], "overlap", Path("r.json"), 0, [])


def test_default_cases_load_their_configs_with_their_arguments():
    """A typo in a default case's config or ``--set`` key fails here, not on the GPU."""
    flags = {"--requests": "loop.requests"}
    for config, args in CASES.values():
        values = {}
        for flag, value in zip(args[::2], args[1::2]):
            key, _, text = value.partition("=") if flag == "--set" else (flags[flag], "", value)
            values[key] = yaml.safe_load(text)
        load_run_config(config, values)


class FakeCli:
    """Writes a run's ``--json`` file like the decode CLI; ``fail`` names configs that exit
    1, ``drift`` configs whose overlapped runs decode request 1 differently."""

    def __init__(self, fail=(), drift=()):
        self.fail, self.drift, self.calls = set(fail), set(drift), []

    def __call__(self, cmd, timeout):
        self.calls.append(cmd)
        config = cmd[cmd.index("--config") + 1]
        if config in self.fail:
            return CompletedProcess(cmd, 1, "", "Traceback\nConfigError: [--overlap] refused")
        overlap = "--overlap" in cmd
        tokens = {0: [1, 2], 1: [3, 9] if overlap and config in self.drift else [3, 4]}
        profiled = "--gpu-busy" in cmd  # a profiler in the loop: slower, and busy measured
        tps = (200.0 if overlap else 100.0) / (10 if profiled else 1)
        busy = (0.99 if overlap else 0.7) if profiled else None
        data = payload(tps, overlap=overlap, tokens=tokens, busy=busy)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(data))
        return CompletedProcess(cmd, 0, "", "")


def test_main_alternates_variants_and_writes_results(tmp_path, capsys):
    cli, out = FakeCli(), tmp_path / "loop.json"
    argv = ["--case", "a=cfg-a:--requests 4", "--case", "b=cfg-b", "--extra=--device cpu"]
    assert main([*argv, "--out", str(out)], runner=cli) == 0
    variants = [next(a for a in cmd if a.endswith("overlap")) for cmd in cli.calls]
    rounds = ["--overlap", "--no-overlap", "--no-overlap", "--overlap"]
    assert variants == (rounds + rounds[:2]) * 2  # two rounds, then one profiled
    profiled = ["--gpu-busy" in cmd for cmd in cli.calls]
    assert profiled == ([False] * 4 + [True] * 2) * 2  # the busy fraction's run, apart
    assert all(cmd[-2:] == ["--device", "cpu"] for cmd in cli.calls)
    captured = capsys.readouterr()
    assert "[10/12] b overlap (round 2/2)" in captured.err
    assert "[12/12] b no-overlap (profiled)" in captured.err
    result = json.loads(out.read_text())["cases"]["a"]
    assert result["speedup"] == 2.0 and result["tokens_equal"] is True  # unprofiled runs
    assert result["overlap"]["gpu_busy"] == 0.99 and result["no-overlap"]["gpu_busy"] == 0.7
    assert "tokens" not in result["runs"]["overlap"][0]  # checked, not kept


def test_main_fails_on_different_tokens_and_on_a_failed_run(capsys):
    assert main(["--case", "a=cfg-a", "--repeats", "1"], runner=FakeCli(drift={"cfg-a"})) == 1
    assert "tokens differ for requests ['1']" in capsys.readouterr().out

    cli = FakeCli(fail={"cfg-a"})
    assert main(["--case", "a=cfg-a", "--case", "b=cfg-b"], runner=cli) == 1
    captured = capsys.readouterr()
    assert "ConfigError: [--overlap] refused" in captured.err  # the stderr tail
    assert "[2/7] b" in captured.err  # a's other runs dropped from the plan
    assert len(cli.calls) == 7 and "a: overlap run failed (exit 1)" in captured.out
