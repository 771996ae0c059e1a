"""The step profiler runs end to end on the CPU (tiny preset) and groups kernels by name,
so the script the GPU calls rely on cannot rot between device sessions."""

from __future__ import annotations

import json

from benchmarks.kernels.profile_step import group_of, main


def test_kernel_names_fall_in_their_groups():
    assert group_of("_attend_kernel") == "sparse_mla"
    assert group_of("void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<x>") == (
        "sparse_mla"
    )
    assert group_of("_row_topk_kernel") == "topk"
    assert group_of("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_splitK_TNT") == "gemm"
    assert group_of("void deep_gemm::sm90_fp8_paged_mqa_logits<1u, 64u>") == "indexer_logits"
    assert group_of("_rms_norm_kernel") == "norm_rope_act"
    assert group_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == (
        "elementwise_other"
    )


def test_tiny_profile_writes_both_phases(tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--preset", "tiny", "--batches", "2", "--contexts", "256", "--steps", "1"]
    assert main([*argv, "--warmup", "1", "--out", str(out), "--device", "cpu"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["graph", "eager"]
    assert rows[0]["graph_replays"] == 2 and rows[1]["graph_replays"] == 0
