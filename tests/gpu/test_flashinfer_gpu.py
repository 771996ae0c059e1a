"""Real FlashInfer (flashinfer-python 0.5.3) against the backends.flashinfer references, on CUDA.

Skipped cleanly without CUDA or without flashinfer. The configurations and
checks are those of ``benchmarks/verify_flashinfer.py`` (its
``flashinfer_configs.py`` and ``flashinfer_replay.py``: one source of truth:
eager, capture and replay within bf16 tolerance of the fp32 reference,
replayed metadata bit-equal to eager, pointers and wrapper bindings fixed, no
synchronising call on the replay path), over smaller limits and fewer
batches. Expect 10-60 s of JIT compilation per FlashInfer module on a cold
cache (decode, tensor-core decode, MLA).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

from benchmarks.flashinfer_configs import CONFIGS  # noqa: E402
from benchmarks.flashinfer_replay import run_config  # noqa: E402


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eager_capture_replay_match_the_reference(name):
    config = replace(CONFIGS[name], max_batch=16, sizes=(1, 2, 4, 8, 16), max_context=1024)
    report = run_config(name, config, torch.device("cuda"), sequences=16, seed=1)
    assert report.ok, report.to_json()
