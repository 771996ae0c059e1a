"""The whole-model GPU benchmarks run end to end on the CPU (tiny preset), every sparse MLA
variant included, so the scripts the device calls rely on cannot rot between sessions."""

from __future__ import annotations

import json

from benchmarks.kernels import model_floor, profile_step, seed_stack


def test_model_floor_times_every_kernel_variant(tmp_path):
    out = tmp_path / "floor.json"
    argv = ["--preset", "tiny", "--batches", "2", "--contexts", "256", "--iters", "1"]
    assert model_floor.main([*argv, "--warmup", "1", "--device", "cpu", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    for name in model_floor.KERNELS:
        assert row[name]["graph_replays"] == 2, name  # warm-up + timed steps, all replays


def test_seed_stack_model_runs_with_flashinfers_sparse_mla_plan(tmp_path):
    out = tmp_path / "seed.json"
    argv = ["--stack", "model", "--preset", "tiny", "--batches", "2", "--contexts", "256"]
    argv += ["--modes", "graph", "--runs", "1", "--warmup", "1", "--iters", "1"]
    argv += ["--mla-kernel", "flashinfer", "--device", "cpu", "--out", str(out)]
    assert seed_stack.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["c_planner"]["schedules_per_step"] == 1.0


def test_sites_attribute_eager_ops_to_source_lines(tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--preset", "tiny", "--batches", "2", "--contexts", "256", "--steps", "1"]
    argv += ["--phases", "eager", "--sites", "--warmup", "1", "--device", "cpu", "--out", str(out)]
    assert profile_step.main(argv) == 0
    sites = json.loads(out.read_text())["rows"][0]["call_sites"]
    assert any(site.startswith("layers.*.attn.indexer @ backends/") for site, *_ in sites)
    assert all(us >= 0 and calls > 0 for _, _, us, calls in sites)


def test_invariant_gemm_benchmark_reports_and_refuses_the_cpu(monkeypatch, capsys):
    """The GEMM benchmark times CUDA kernels only: on the CPU it says so. Its report (the
    table and the per-M sums the plot draws) runs here on a recorded result."""
    from benchmarks.kernels import invariant_gemm
    from dsv32_engine.models.layers.invariant_gemm import tile_config

    monkeypatch.setattr("sys.argv", ["invariant_gemm"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    try:
        invariant_gemm.main()
    except SystemExit as exc:
        assert "no CUDA device" in str(exc)
    else:
        raise AssertionError("ran without CUDA")
    config = tile_config(2240, 7168, 1, False)
    assert invariant_gemm._unsplit(config, 2240, 1) == (64, 16, 64, 4, 4, 1)  # the old rule
    rows = [
        {"site": s, "n": 1, "k": 1, "groups": 1, "m": m, "config": list(config),
         "floor_us": 1.0, "us": {"cublas": 2.0, "invariant": 3.0}, "row_invariant": True}
        for s in ("a", "b") for m in (1, 64)
    ]  # fmt: skip
    result = {"copy_bandwidth_gbs": 2000.0, "rows": rows}
    assert invariant_gemm.sums(result) == {
        1: {"cublas": 4.0, "invariant": 6.0},
        64: {"cublas": 4.0, "invariant": 6.0},
    }
    invariant_gemm.table(result)
    assert "inv/cublas" in capsys.readouterr().out
