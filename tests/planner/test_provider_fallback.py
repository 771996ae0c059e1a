"""Faults: a library missing or broken, a provider failing its first call, a capture failing.

What must happen: the planner takes the next provider (or the runner runs that size
eagerly / pads it to the next one), says so once (a warning, never one per step), and
keeps serving plans equal to the exact references.

Simulated on the CPU: deep_gemm through its lazy loader (``backends/deepgemm/_native.py``
``load()`` / ``reset()``), FlashInfer through the import machinery its availability check
uses, provider choice for a CUDA planner (``Limits(device="cuda:0")`` builds and selects
providers without touching a GPU), a failing provider by making it the chosen one, and
capture failures inside the decode engine's graph runner.

Where the planner has no fallback today, the test is ``xfail(strict=True)`` and its reason
says what is missing; docs/reliability.md lists the smallest fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import random
import sys
import types
import warnings
from dataclasses import replace

import pytest
import torch

import backends.deepgemm._native as native
from backends.flashinfer import wrappers
from graphs import SIZE_DROPPED, GraphWarning, is_capturing
from planner import ForwardMode, Limits, Planner, get_op
from planner.compare import diff_plans
from planner.errors import ProviderError
from planner.ops import MetadataOp, Provider
from serving.engine import DecodeEngine
from serving.run_config import load_run_config
from tests.support import TINY_YAML
from tests.support.batches import make_pool, random_batch

CUDA0 = torch.device("cuda", 0)
MAX_CTX, PAGE = 256, 64
TABLE = make_pool(9, MAX_CTX, PAGE)


def _limits(device: str = "cpu") -> Limits:
    return Limits(max_batch=4, max_context=MAX_CTX, page_size=PAGE, device=device)


def _batches(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [random_batch(rng, TABLE, max_batch=4, max_context=MAX_CTX) for _ in range(n)]


@pytest.fixture
def fresh_deep_gemm():
    """Forget deep_gemm's cached import before and after (the loader remembers failures)."""
    native.reset()
    yield
    native.reset()


def _block_import(monkeypatch, name: str, exc: BaseException) -> None:
    """``import name`` raises ``exc``, as a missing or ABI-broken install does."""
    real = importlib.import_module

    def fake(module: str, package: str | None = None):
        if module == name or module.startswith(name + "."):
            raise exc
        return real(module, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    monkeypatch.delitem(sys.modules, name, raising=False)


def _runtime_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# ---- deep_gemm missing or failing to import ----------------------------------------------------


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
    _block_import(monkeypatch, "deep_gemm", exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [Planner(["nsa"], _limits("cuda:0")).providers_chosen() for _ in range(3)]
    assert {c["nsa.schedule"] for c in chosen} == {"torch"}
    said = [m for m in _runtime_warnings(caught) if "deep_gemm is unavailable" in m]
    assert len(said) == 1 and type(exc).__name__ in said[0]


def test_deep_gemm_present_is_chosen_on_cuda(monkeypatch, fresh_deep_gemm):
    """The control: the same selection picks deep_gemm when it imports."""
    fake = types.ModuleType("deep_gemm")
    fake.get_paged_mqa_logits_metadata = lambda *a: None
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    assert Planner(["nsa"], _limits("cuda:0")).providers_chosen()["nsa.schedule"] == "deep_gemm"
    # and on the CPU the reference is chosen without even trying the import
    native.reset()
    assert Planner(["nsa"], _limits()).providers_chosen()["nsa.schedule"] == "torch"


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
    said = [m for m in _runtime_warnings(caught) if "availability check failed" in m]
    assert len(said) == 1 and "libcuda" in said[0]


# ---- FlashInfer missing or failing to import ---------------------------------------------------


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
        assert _flashinfer_plan_provider(Planner([backend], _limits("cuda:0"))) == "torch"


def test_flashinfer_missing_on_cuda_is_said_once(monkeypatch, no_flashinfer_module):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            Planner(["flashinfer_decode"], _limits("cuda:0"))
    assert len([m for m in _runtime_warnings(caught) if "flashinfer" in m.lower()]) == 1


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
    _block_import(monkeypatch, "flashinfer", exc)
    assert _flashinfer_plan_provider(Planner(["flashinfer_decode"], _limits("cuda:0"))) == "torch"


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
    planner = Planner(["nsa", "paged"], _limits())
    reference = Planner(["nsa", "paged"], _limits())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _batches(5):
            assert not diff_plans(planner.plan(batch), reference.plan(batch))
    said = [m for m in _runtime_warnings(caught) if provider in m]
    # Each planner (the one under test and the reference) tries the provider once, then never again.
    assert len(said) == 1 and len(calls) == 2


@pytest.mark.parametrize("failing_provider", FAILING, indirect=True, ids=lambda p: "/".join(p))
def test_a_forced_provider_that_fails_is_an_error_not_a_fallback(failing_provider):
    op_name, provider, calls = failing_provider
    planner = Planner(["nsa", "paged"], _limits(), providers={op_name: provider})
    with pytest.raises(ProviderError, match="forced provider failed") as info:
        planner.plan(_batches(1)[0])
    assert info.value.actual == provider


# ---- a capture (or its JIT warm-up) failing for one size, in the decode engine ---------------

SMALL = {
    "loop.requests": 8,
    "loop.prompt_len": [2, 6],
    "loop.max_new_tokens": [4, 20],
    "loop.arrival_rate": 2.0,
    "planner.max_batch": 8,
    "planner.max_context": 128,
    "model.overrides": {"num_hidden_layers": 2},
}
"""Batches of 1..8 on the ladder 1, 2, 4, 8."""


def _engine(**overrides) -> DecodeEngine:
    return DecodeEngine(load_run_config(TINY_YAML, SMALL | overrides))


@pytest.fixture(scope="module")
def eager_tokens():
    """The reference: the same workload with graphs off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        return _engine(**{"graphs.enabled": False}).run(progress=False).tokens


def _fail_capture_of(engine: DecodeEngine, size: int) -> None:
    inner = engine.runner.forward

    def forward(inputs, plans):
        if is_capturing() and plans.reqs == size:
            raise RuntimeError("CUDA error: out of memory (simulated, during capture)")
        return inner(inputs, plans)

    engine.runner.forward = forward


def _fail_first_warmup(engine: DecodeEngine, monkeypatch) -> None:
    """The schedule provider's warm-up hook fails, as a deep_gemm JIT compile would."""

    def warmup(*args):
        raise RuntimeError("deep_gemm JIT: failed to compile paged_mqa_logits_metadata (simulated)")

    for step in engine.planner.program(ForwardMode.DECODE).steps:
        if step.op_name == "paged_mqa_schedule":
            monkeypatch.setattr(step.chain, "current", replace(step.provider, warmup=warmup))


def test_capture_failure_drops_one_size_and_serves_identical_tokens(eager_tokens):
    engine = _engine(**{"planner.debug": True})  # every replay re-planned eagerly and compared
    _fail_capture_of(engine, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    assert len(said) == 1 and "batch size 4 failed and was dropped" in said[0]
    stats = engine.runner.stats
    assert stats.captured["decode"] == [1, 2, 8] and list(stats.dropped["decode"]) == [4]
    assert stats.eager == {}  # batches of 3 and 4 pad to 8 instead
    assert stats.replays[("decode", 8)] > 0 and stats.replays[("decode", 4)] == 0
    assert engine.planner.stats.verified == result.decode_steps
    assert result.tokens == eager_tokens


def test_failed_warmup_drops_the_largest_size_runs_it_eagerly_and_says_so_once(
    eager_tokens, monkeypatch
):
    engine = _engine(**{"planner.debug": True})
    _fail_first_warmup(engine, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    assert len(said) == 2, said  # the drop, then the first eager fallback; never per step
    assert "batch size 8 failed" in said[0] and "JIT" in said[0] and SIZE_DROPPED in said[1]
    stats = engine.runner.stats
    assert list(stats.dropped["decode"]) == [8] and stats.captured["decode"] == [1, 2, 4]
    assert stats.eager[SIZE_DROPPED] > 1 and stats.graph_steps > 0
    assert result.tokens == eager_tokens
