"""A smoke run of ``python -m benchmarks moe_topk`` on the CPU, so the GPU script cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kernels import moe_topk as bench


def test_bench_moe_topk_smoke(tmp_path: Path) -> None:
    result = bench.run(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_moe_topk.json").read_text())
    assert result["failures"] == [] == saved["failures"]
    assert [(r["shape"], r["rows"]) for r in saved["moe"]] == [("tiny", 1), ("tiny", 4)]
    assert all(r["routed_err"] < 1e-6 and r["routed"]["median_us"] > 0 for r in saved["moe"])
    assert {r["lengths"] for r in saved["topk"]} == {"random", "short300", "full"}
