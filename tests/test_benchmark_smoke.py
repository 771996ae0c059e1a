"""CPU smoke runs of the benchmarks no other test runs whole: each runs to its end on the
CPU at a tiny size (or, GPU-only, refuses there in one line), so a broken benchmark fails
here rather than in a scarce device call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.host import debug_cost, planner_overhead, profile_host
from benchmarks.kernels import weights_proj_gemm
from benchmarks.loop import loop_profile, overlap_loop
from tests.support import REPO


def test_debug_cost_times_both_modes_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "debug_cost.json"
    argv = ["--configs", "tiny", "--steps", "12", "--warmup", "2", "--out", str(out)]
    assert debug_cost.main(argv) == 0
    rows = json.loads(out.read_text())
    assert "tiny" in json.dumps(rows)
    assert "debug" in capsys.readouterr().out.lower()


def test_overlap_loop_runs_both_loops_and_compares_their_tokens(tmp_path, capsys):
    out = tmp_path / "overlap_loop.json"
    argv = [
        "--case",
        "tiny=dsv32-tiny:--requests 3 --max-steps 12",
        "--gpu-busy",
        "0",
        "--repeats",
        "1",
        "--extra=--device cpu",
        "--out",
        str(out),
    ]
    assert overlap_loop.main(argv) == 0
    text = capsys.readouterr().out
    assert "tiny" in text and "yes" in text  # the tokens of both loops are equal
    assert json.loads(out.read_text())


def test_loop_profile_profiles_a_window_of_steps_with_each_tool(tmp_path, capsys):
    out = tmp_path / "loop_profile.json"
    argv = ["--config", "dsv32-tiny", "--requests", "3", "--new", "30", "--start", "8"]
    argv += ["--steps", "10", "--set", "loop.prompt_len=[4,8]", "--out", str(out)]
    argv += ["--trace", str(tmp_path / "trace.json")]
    assert loop_profile.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["torch"]["device_gaps"] == {"device_ops_per_step": 0.0}  # no device here
    assert set(results) == {"none", "cprofile", "torch"}
    assert all(r["window_ms_per_step"] > 0 for r in results.values())
    steps = {row["function"] for row in results["cprofile"]["inclusive"]}
    assert any("engine.py" in name and "(step)" in name for name in steps)
    assert "by self time" in capsys.readouterr().out


def test_device_gaps_splits_a_trace_into_graph_gaps_and_waits_between_launches():
    def x(name, cat, ts, dur, corr):
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "ts": ts,
            "dur": dur,
            "args": {"correlation": corr},
        }

    events = [
        x("cudaGraphLaunch", "cuda_runtime", 0, 5, 1),
        x("k0", "kernel", 10, 10, 1),  # the graph: two kernels, 1 us apart
        x("k1", "kernel", 21, 9, 1),
        x("Memcpy DtoH", "gpu_memcpy", 35, 2, 7),  # beside it, 5 us after the graph
        x("k2", "kernel", 36, 4, 8),  # overlaps the copy (another stream): no gap
        x("cudaLaunchKernel", "cuda_runtime", 30, 1, 8),
    ]
    gaps = loop_profile.device_gaps(events, steps=1)
    assert gaps["in_graph_ops_per_step"] == 2 and gaps["beside_ops_per_step"] == 2
    assert gaps["device_us_per_step"] == 25
    assert (gaps["graph_gaps_per_step"], gaps["graph_gap_us_per_step"]) == (1, 1)
    assert (gaps["other_gaps_per_step"], gaps["other_gap_us_per_step"]) == (1, 5)
    assert loop_profile.device_gaps([], steps=3) == {"device_ops_per_step": 0.0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_weights_proj_gemm_refuses_without_cuda_in_one_line(capsys):
    assert weights_proj_gemm.main(["--rows", "1"]) == 2
    assert capsys.readouterr().out.strip() == "needs CUDA: this compares GPU kernels"


@pytest.mark.triton
def test_sparse_mla_sm90_report_compiles_a_config_for_hopper(tmp_path):
    """Triton's compiler and its bundled ptxas and cuobjdump, no GPU, in a process of its
    own (the interpreter off, as on a GPU)."""
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    argv = ["--heads", "16", "--configs", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "sparse_mla_sm90_report", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert all(r["registers"] > 0 for r in rows)


def test_planner_overhead_times_the_planner_beside_hand_written_code(tmp_path, capsys):
    out = tmp_path / "po.json"
    argv = ["--batches", "1", "4", "--warmup", "2", "--iters", "5"]
    argv += ["--flashinfer", "--device", "cpu", "--out", str(out)]
    assert planner_overhead.main(argv) == 0
    assert "planner host time per call" in capsys.readouterr().out
    assert json.loads(out.read_text())


def test_profile_host_profiles_replay_step_and_eager_plan(tmp_path, capsys):
    out = tmp_path / "ph.json"
    argv = ["--batch", "4", "--iters", "3", "--device", "cpu"]
    assert profile_host.main([*argv, "--out", str(out)]) == 0
    assert json.loads(out.read_text())
