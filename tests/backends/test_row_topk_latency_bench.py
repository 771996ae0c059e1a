"""A smoke run of ``python -m benchmarks row_topk_latency`` on the CPU, so the GPU script
cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kernels import row_topk_latency as bench


@pytest.mark.triton
def test_row_topk_latency_smoke(tmp_path: Path) -> None:
    out = tmp_path / "row_topk_latency.json"
    assert bench.main(["--smoke", "--device", "cpu", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["mismatches"] == []
    results = saved["results"]
    assert {(r["rows"], r["lengths"]) for r in results} == {
        (rows, kind) for rows in (1, 4) for kind in ("random", "full")
    }
    configs = {r["config"] for r in results}
    # The baseline, the resident default at both smoke digit widths, and a block small
    # enough that the smoke rows take the re-read chunks.
    res = bench.default_resident(256)
    assert {
        "chunked",
        f"resident{res}-d5-w4",
        f"resident{res}-d8-w4",
        "resident64-d5-w4",
    } == configs
    assert all(r["ok"] and r["median_us"] > 0 for r in results)
    assert set(saved["best"]) == {f"256/{rows}/{kind}/pos" for rows in (1, 4) for kind in
                                  ("random", "full")}  # fmt: skip


def test_row_topk_latency_refuses_cpu_without_smoke(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--device", "cpu"]) == 2
    assert "--smoke" in capsys.readouterr().out
