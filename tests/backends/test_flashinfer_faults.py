"""FlashInfer missing or broken: FlashInfer plans use the torch bookkeeping instead.

Simulated on the CPU through the import machinery FlashInfer's availability check uses
(``importlib.util.find_spec``, ``importlib.import_module``) and a CUDA planner
(``Limits(device="cuda:0")``, built under ``pretend_cuda``, selects providers without
touching a GPU).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import warnings

import pytest

from backends.flashinfer import wrappers
from planner import ForwardMode, Planner
from tests.support.faults import FAULTS, block_import, runtime_warnings

CUDA_LIMITS = FAULTS.make_limits(device="cuda:0", fake_cuda=True)


def _flashinfer_plan_provider(planner: Planner) -> str:
    (name,) = [
        s.provider.name
        for s in planner.program(ForwardMode.DECODE).steps
        if s.op_name == "flashinfer_plan"
    ]
    return name


@pytest.fixture
def no_flashinfer_module(monkeypatch):
    monkeypatch.setattr(wrappers, "_module", None)
    monkeypatch.setattr(wrappers, "_failure", None)


def test_flashinfer_missing_falls_back_to_the_torch_bookkeeping(monkeypatch, no_flashinfer_module):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    for backend in ("flashinfer_decode", "flashinfer_mla"):
        assert _flashinfer_plan_provider(Planner([backend], CUDA_LIMITS)) == "torch"


def test_flashinfer_missing_on_cuda_is_said_once(monkeypatch, no_flashinfer_module):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            Planner(["flashinfer_decode"], CUDA_LIMITS)
    assert len([m for m in runtime_warnings(caught) if "flashinfer" in m.lower()]) == 1


@pytest.mark.parametrize(
    "exc",
    [
        ImportError("cannot import name 'BatchMLAPagedAttentionWrapper'"),
        OSError("undefined symbol"),
    ],
    ids=["import-error", "abi-mismatch"],
)
def test_flashinfer_broken_install_falls_back(exc, monkeypatch, no_flashinfer_module):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: importlib.machinery.ModuleSpec(n, None) if n == "flashinfer" else real(n, *a),
    )
    block_import(monkeypatch, "flashinfer", exc)
    assert _flashinfer_plan_provider(Planner(["flashinfer_decode"], CUDA_LIMITS)) == "torch"
