"""Suite-wide settings (Triton interpreter and one torch thread on the CPU; GPU tests skip
without CUDA) and the fixtures every folder uses."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, Triton kernels run under the interpreter. Triton decides at import time
# (its own library functions are jitted then), so this must precede any triton import.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import backends.deepgemm._native as native  # noqa: E402
from backends.common.triton_kernels import triton_available  # noqa: E402
from planner import PlanSet  # noqa: E402
from planner import ops as ops_module  # noqa: E402
from planner import registry as registry_module  # noqa: E402
from tests.support.dumps import probe_dump  # noqa: E402

# The CPU suite runs tiny tensors on 2 cores: one thread avoids OpenMP spin-waits
# that make small matmuls tens of times slower under contention.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The suite's two switches, each decided here only: ``gpu`` tests skip without CUDA,
    and ``triton`` tests skip where Triton cannot run on their tensors' device. CI runs the
    suite without Triton, then installs it and runs ``-m triton``: a test that skipped for
    want of Triton any other way would run in neither (``tests/test_triton_marker.py``)."""
    no_cuda = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if no_cuda is not None and "gpu" in item.keywords:
            item.add_marker(no_cuda)
        mark = item.get_closest_marker("triton")
        if mark is not None:
            # CPU tensors unless told: on a GPU machine TRITON_INTERPRET is off (above), so
            # the interpreter tests skip there and the CUDA ones (device=DEVICE) run.
            device = torch.device(mark.kwargs.get("device", "cpu"))
            if not triton_available(device):
                reason = (
                    f"Triton cannot run on {device} here: it needs Triton (pip install -e "
                    "'.[dev]') and, on the CPU, TRITON_INTERPRET=1 (set by tests/conftest.py "
                    "where there is no GPU)"
                )
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def isolated_registries():
    """The test's own backends and ops are forgotten when it ends: the registries are
    process-wide, and a test schema left registered (one naming an op that does not exist,
    on purpose) would show up in every later listing of the registered backends. For tests
    that declare throwaway schemas inside the test (not for schemas built once per
    process and cached)."""
    backends = registry_module.all_plan_classes()  # loads the entry points first
    ops = dict(ops_module.all_ops())
    yield
    registry_module._BACKENDS.clear()
    registry_module._BACKENDS.update(backends)
    ops_module._OPS.clear()
    ops_module._OPS.update(ops)


@pytest.fixture
def fresh_deep_gemm():
    """Forget deep_gemm's cached import before and after (the loader remembers failures)."""
    native.reset()
    yield
    native.reset()


@pytest.fixture
def one_dump(tmp_path) -> tuple[Path, PlanSet]:
    """A plan dump on disk (step 42, label 'probe') and the plans it holds."""
    return probe_dump(tmp_path)
