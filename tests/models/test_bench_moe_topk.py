"""A smoke run of benchmarks/bench_moe_topk.py on the CPU, so the GPU script cannot rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.support import REPO

BENCH = REPO / "benchmarks" / "bench_moe_topk.py"


def test_bench_moe_topk_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_moe_topk", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_moe_topk.json").read_text())
    assert result["failures"] == [] == saved["failures"]
    assert [(r["shape"], r["rows"]) for r in saved["moe"]] == [("tiny", 1), ("tiny", 4)]
    assert all(r["routed_err"] < 1e-6 and r["routed"]["median_us"] > 0 for r in saved["moe"])
    assert {r["lengths"] for r in saved["topk"]} == {"random", "short300", "full"}
