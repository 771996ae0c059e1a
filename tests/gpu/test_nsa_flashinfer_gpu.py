"""FlashInfer's sparse MLA through the planner's ``nsa_flashinfer`` plan, on CUDA.

Skipped cleanly without CUDA or without flashinfer. The checks are those of
``benchmarks/verify/sparse_flashinfer.py`` (one source of truth) over fewer batches and
sizes: every batch within 2e-2 of the fp32 reference, rows shorter and longer than
top-k, and the captured layer replayed over new slots and lengths equal to eager calls.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

from benchmarks.verify import sparse_flashinfer  # noqa: E402


def test_planned_flashinfer_sparse_mla_matches_the_reference_and_replays(tmp_path):
    out = tmp_path / "result.json"
    argv = ["--sizes", "1", "5", "16", "--ctx", "2560", "--batches", "24"]
    rc = sparse_flashinfer.main([*argv, "--iters", "5", "--host-iters", "10", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, result["correctness"] | result["graphs"]
    assert result["correctness"]["rows_shorter_than_topk"] > 0
    assert all(r["plans_during_memo_hits"] == 0 for r in result["speed"])  # the memo held
