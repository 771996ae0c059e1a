"""Real FlashInfer (flashinfer-python 0.5.3) against the backends.flashinfer references, on CUDA.

Skipped cleanly without CUDA or without flashinfer. The configurations and
checks are those of ``benchmarks/verify_flashinfer.py`` (one source of
truth: eager, capture and replay within bf16 tolerance of the fp32 reference,
replayed metadata bit-equal to eager, pointers and wrapper bindings fixed, no
synchronising call on the replay path), over smaller limits and fewer
batches. Expect 10-60 s of JIT compilation per FlashInfer module on a cold
cache (decode, tensor-core decode, MLA).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import pytest
import torch

from tests.support import REPO

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

_SCRIPT = REPO / "benchmarks" / "verify_flashinfer.py"
_spec = importlib.util.spec_from_file_location("verify_flashinfer", _SCRIPT)
verify = importlib.util.module_from_spec(_spec)
sys.modules["verify_flashinfer"] = verify  # dataclasses look their module up while it executes
_spec.loader.exec_module(verify)


@pytest.mark.parametrize("name", sorted(verify.CONFIGS))
def test_eager_capture_replay_match_the_reference(name):
    config = replace(verify.CONFIGS[name], max_batch=16, sizes=(1, 2, 4, 8, 16), max_context=1024)
    report = verify.run_config(name, config, torch.device("cuda"), sequences=16, seed=1)
    assert report.ok, report.to_json()
