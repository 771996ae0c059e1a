"""deep_gemm missing, ABI-broken or without CUDA: a CUDA planner takes the torch reference.

Simulated on the CPU through deep_gemm's lazy loader (``backends/deepgemm/_native.py``
``load()`` / ``reset()``) and a CUDA planner (``Limits(device="cuda:0")``, built under
``pretend_cuda``, selects providers without touching a GPU). The fallback is said once
per process, however many planners are built.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest

import backends.deepgemm._native as native
from tests.support.faults import FAULTS, block_import, runtime_warnings


@pytest.mark.parametrize(
    "exc",
    [
        ModuleNotFoundError("No module named 'deep_gemm'"),
        OSError("deep_gemm_cpp.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"),
        AssertionError("Torch not compiled with CUDA enabled"),
    ],
    ids=["missing", "abi-mismatch", "no-cuda"],
)
def test_deep_gemm_import_failure_falls_back_to_the_reference_once(
    exc, monkeypatch, fresh_deep_gemm
):
    block_import(monkeypatch, "deep_gemm", exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [
            FAULTS.planner(["nsa"], device="cuda:0", fake_cuda=True).providers_chosen()
            for _ in range(3)
        ]
    assert {c["nsa.schedule"] for c in chosen} == {"torch"}
    said = [m for m in runtime_warnings(caught) if "deep_gemm is unavailable" in m]
    assert len(said) == 1 and type(exc).__name__ in said[0]


def test_deep_gemm_present_is_chosen_on_cuda(monkeypatch, fresh_deep_gemm):
    """The control: the same selection picks deep_gemm when it imports."""
    fake = types.ModuleType("deep_gemm")
    fake.get_paged_mqa_logits_metadata = lambda *a: None
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    assert (
        FAULTS.planner(["nsa"], device="cuda:0", fake_cuda=True).providers_chosen()["nsa.schedule"]
        == "deep_gemm"
    )
    # and on the CPU the reference is chosen without even trying the import
    native.reset()
    assert FAULTS.planner(["nsa"]).providers_chosen()["nsa.schedule"] == "torch"
