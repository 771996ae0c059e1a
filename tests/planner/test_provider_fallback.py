"""Faults in the planner's provider choice: an availability check that crashes, a provider
that fails its first call (a JIT compile error).

What must happen: the planner takes the next provider, says so once (a warning, never one
per step), and keeps serving plans equal to the exact references; a provider the config
forced is not replaced. Simulated on the CPU by making the failing provider the chosen
one, the way CUDA would choose it. (Optional libraries that do not import are in
``tests/backends/test_*_faults.py``; capture failures in the engine in
``tests/serving/test_engine_faults.py``.)
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from planner import get_op
from planner.debug import diff_plans
from planner.errors import ProviderError
from planner.ops import MetadataOp, Provider
from tests.support.faults import FAULTS, runtime_warnings

CUDA0 = torch.device("cuda", 0)


def _batches(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [FAULTS.batch(rng) for _ in range(n)]


def test_a_crashing_availability_check_counts_as_unavailable_and_is_said_once(monkeypatch):
    op = get_op("page_table")

    def broken(device):
        raise RuntimeError("triton: libcuda.so.1 cannot be opened")

    monkeypatch.setitem(
        op.providers, "triton", dataclasses.replace(op.providers["triton"], available=broken)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert op.select(CUDA0).name == "torch"
    said = [m for m in runtime_warnings(caught) if "availability check failed" in m]
    assert len(said) == 1 and "libcuda" in said[0]


# ---- a provider that fails its first call (a JIT compile error) --------------------------------


@pytest.fixture
def failing_provider(monkeypatch, request):
    """Make ``op``'s best provider one whose first call raises, and the planner choose it.

    On the CPU the planner chooses the torch reference whatever else is installed, so the
    choice is forced here the way CUDA would make it: the preferred available provider.
    """
    op_name, provider = request.param
    op = get_op(op_name)
    calls = []

    def jit_fails(out, *args, **params):
        calls.append(1)
        raise RuntimeError(f"{provider}: JIT compilation failed (nvcc exited with status 1)")

    monkeypatch.setitem(
        op.providers, provider, Provider(provider, jit_fails, True, lambda d: True, rank=-1)
    )
    original = MetadataOp.select

    def select(self, device, forced=None):
        if self is op and forced is None:
            return self.providers[provider]
        return original(self, device, forced)

    monkeypatch.setattr(MetadataOp, "select", select)
    return op_name, provider, calls


FAILING = [("paged_mqa_schedule", "deep_gemm"), ("page_table", "triton")]


@pytest.mark.parametrize("failing_provider", FAILING, indirect=True, ids=lambda p: "/".join(p))
def test_provider_failing_its_first_call_falls_back_to_the_next(failing_provider):
    op_name, provider, calls = failing_provider
    planner, reference = FAULTS.planner(), FAULTS.planner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _batches(5):
            assert not diff_plans(planner.plan(batch), reference.plan(batch))
    said = [m for m in runtime_warnings(caught) if provider in m]
    # Each planner (the one under test and the reference) tries the provider once, then never again.
    assert len(said) == 1 and len(calls) == 2


@pytest.mark.parametrize("failing_provider", FAILING, indirect=True, ids=lambda p: "/".join(p))
def test_a_forced_provider_that_fails_is_an_error_not_a_fallback(failing_provider):
    op_name, provider, calls = failing_provider
    planner = FAULTS.planner(providers={op_name: provider})
    with pytest.raises(ProviderError, match="forced provider failed") as info:
        planner.plan(_batches(1)[0])
    assert info.value.actual == provider
