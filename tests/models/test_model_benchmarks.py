"""The whole-model GPU benchmarks run end to end on the CPU (tiny preset), every sparse MLA
variant included, so the scripts the device calls rely on cannot rot between sessions."""

from __future__ import annotations

import json

from benchmarks import model_floor, profile_step, seed_stack


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
