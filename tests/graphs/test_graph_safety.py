"""Graph safety on the CPU: the emulated capture refuses what a CUDA capture would not survive.

A throwaway backend (one plan field computed by a throwaway op) is registered per test with
the provider under test; the registries are restored afterwards. Each kind of host sync,
data-dependent shape and allocation outside the pool is refused while an
``EmulatedGraph`` captures the planner's ``record``, naming the op, the provider and the
plan field; the same provider runs untouched eagerly, at ``Planner.capture`` (before the
graph), at an emulated replay, and as a ``graph_safe=False`` host op.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import planner.ops as ops_module
import planner.registry as registry_module
from graphs import CaptureGuard, EmulatedGraph, GraphRunner, GraphSafetyError
from graphs.capture_guard import guarding
from planner import ForwardMode, Limits, Plan, Planner, Tensor, tensor_field
from planner.ops import capture_guarded, metadata_op, running_provider
from tests.support.batches import make_pool, random_batch

OP, BACKEND, FIELD = "graph_safety_probe", "graph-safety-probe", "probe"
KEY = f"{BACKEND}.{FIELD}"
PAGE, MAX_CTX, MAX_BATCH, POOL = 4, 32, 4, 8
Provider = Callable[..., Any]


def _safe(out: torch.Tensor, lens: torch.Tensor) -> None:
    out.copy_(lens + 1)


def _then_safe(bad: Callable[[torch.Tensor], Any], *, skip: int = 0) -> Provider:
    """A provider that does ``bad(lens)`` (from its call ``skip`` on) and then writes what
    the safe one writes: outside a capture nothing about it is wrong, so every refusal is
    the guard's."""
    calls = []

    def provider(out: torch.Tensor, lens: torch.Tensor, **params: Any) -> None:
        calls.append(1)
        if len(calls) > skip:
            bad(lens)
        _safe(out, lens)

    return provider


def _needs_pinned_memory(kind: str) -> None:
    """Pinning needs an accelerator's allocator: outside a capture (where nothing refuses
    it first) a CPU-only torch raises on it, whoever calls it."""
    if kind.startswith("pin_memory") and not torch.cuda.is_available():
        pytest.skip("no pinned-memory allocator without CUDA")


KINDS: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "item": (lambda x: x[0].item(), ".item()"),
    "cpu": (lambda x: x.cpu(), ".cpu()"),
    "to_cpu": (lambda x: x.to("cpu"), ".to(cpu)"),
    "tolist": (lambda x: x.tolist(), ".tolist()"),
    "numpy": (lambda x: x.numpy(), ".numpy()"),
    "np_asarray": (lambda x: np.asarray(x), ".__array__()"),
    "bool": (lambda x: bool(x[0] > 0), "bool(tensor)"),
    "int": (lambda x: int(x[0]), "int(tensor)"),
    "float": (lambda x: float(x[0]), "float(tensor)"),
    "index": (lambda x: [0, 1, 2][x[0] % 3], "__index__"),
    "format": (lambda x: f"{x[0]}", "formatting a tensor"),
    "equal": (lambda x: torch.equal(x, x), "torch.equal"),
    "nonzero": (lambda x: torch.nonzero(x), "torch.nonzero"),
    "nonzero_method": (lambda x: x.nonzero(), ".nonzero()"),
    "where_one_arg": (lambda x: torch.where(x > 1), "torch.where(cond)"),
    "unique": (lambda x: torch.unique(x), "torch.unique"),
    "masked_select": (lambda x: torch.masked_select(x, x > 1), "torch.masked_select"),
    "mask_index": (lambda x: x[x > 1], "x[mask]"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, x), "torch.repeat_interleave"),
    "pin_memory_kwarg": (lambda x: torch.empty(4, pin_memory=True), "pin_memory=True"),
    "pin_memory_method": (lambda x: x.pin_memory(), ".pin_memory()"),
    "tensor_from_list": (lambda x: torch.tensor([1, 2, 3]), "torch.tensor"),
    "as_tensor_from_list": (lambda x: torch.as_tensor([1, 2, 3]), "torch.as_tensor"),
    "from_numpy": (lambda x: torch.from_numpy(np.arange(3)), "torch.from_numpy"),
}
"""Each refused kind: what the provider does, and how the error names it."""

ALLOWED = {
    "to_dtype": lambda x: x.to(torch.int64),
    "to_own_device": lambda x: x.to(x.device),
    "repeat_interleave_output_size": lambda x: torch.repeat_interleave(
        x, torch.ones_like(x), output_size=x.shape[0]
    ),
    "repeat_interleave_int": lambda x: torch.repeat_interleave(x, 2),
    "where_three_args": lambda x: torch.where(x > 1, x, 0),
    "integer_index": lambda x: x[x.long().clamp(max=0)],
    "as_tensor_of_tensor": lambda x: torch.as_tensor(x),
    "shape_arithmetic": lambda x: torch.zeros(x.shape[0] * 2, dtype=x.dtype),
}
"""Graph-safe code that looks close to a refused kind."""


@pytest.fixture
def register(monkeypatch):
    """``register(fn, graph_safe=True)``: the throwaway op with ``fn`` as its torch
    provider, and a backend whose one op field it computes; both registries are restored."""
    registry_module.load_backends()
    monkeypatch.setattr(ops_module, "_OPS", dict(ops_module._OPS))
    monkeypatch.setattr(registry_module, "_BACKENDS", dict(registry_module._BACKENDS))

    def make(fn: Provider, *, graph_safe: bool = True) -> None:
        op = metadata_op(OP, "out = lens + 1, with a provider under test.")
        op.provider("torch", graph_safe=graph_safe)(fn)

        class ProbePlan(Plan, backend=BACKEND):
            seq_lens: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
            probe: Tensor = tensor_field(torch.int32, ("reqs",), op=OP, inputs=("seq_lens",), pad=2)

    return make


def _planner() -> tuple[Planner, torch.Tensor]:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CTX, page_size=PAGE)
    return Planner([BACKEND], limits, debug=False), make_pool(POOL, MAX_CTX, PAGE, seed=0)


def _batch(table: torch.Tensor, bs: int = 2):
    return random_batch(random.Random(1), table, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=bs)


def _capture(planner: Planner, table: torch.Tensor, bs: int = 2) -> EmulatedGraph:
    """The runner's order: plans over static buffers, then ``record`` inside the graph."""
    plans = planner.capture(bs, req_to_token=table)
    graph = EmulatedGraph()

    def body() -> torch.Tensor:
        planner.record(bs)
        return plans[BACKEND].probe

    graph.capture(body)
    return graph


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_emulated_capture_refuses_the_kind_naming_op_provider_and_field(register, kind):
    bad, named = KINDS[kind]
    register(_then_safe(bad, skip=1))  # Planner.capture's call runs before the graph
    planner, table = _planner()
    with pytest.raises(GraphSafetyError) as caught:
        _capture(planner, table)
    error = caught.value
    assert (error.op, error.provider, error.field) == (OP, "torch", KEY)
    assert named in error.what
    message = str(error)
    assert f"op {OP!r} provider 'torch'" in message and f"[{KEY}]" in message
    assert "test_graph_safety.py" in error.where and "<lambda>" in error.where
    assert "\n" not in message
    assert not guarding() and not capture_guarded()  # the guard is gone after the refusal
    assert torch.from_numpy(np.zeros(1)).shape == (1,)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_same_provider_runs_eagerly_at_plan_capture_and_at_replay(register, kind):
    """Only the graph capture is guarded: an eager plan, the planner's capture (before the
    graph) and an emulated replay run the provider as they always did."""
    _needs_pinned_memory(kind)
    bad, _ = KINDS[kind]
    calls = []

    def provider(out, lens, **params):
        calls.append(guarding())
        _then_safe(bad)(out, lens)

    register(provider)
    planner, table = _planner()
    batch = _batch(table)
    eager = planner.plan(batch, pad_to=2)
    assert torch.equal(eager[BACKEND].probe, batch.seq_lens_cpu + 1)
    captured = planner.capture(2, req_to_token=table)
    replaying = []

    def body() -> torch.Tensor:  # records the op on replays only: the capture has no sync
        if replaying:
            planner.record(2)
        return captured[BACKEND].probe * 1

    graph = EmulatedGraph()
    out = graph.capture(body)
    replaying.append(True)
    planner.replay(batch, 2)
    graph.replay()
    assert torch.equal(out, eager[BACKEND].probe)
    assert len(calls) == 3 and not any(calls)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_graph_unsafe_provider_may_do_it_it_runs_before_the_graph(register, kind):
    """``graph_safe=False``: the planner runs the op at capture and replay, outside the
    graph, so nothing refuses it, through a whole runner's capture and replays."""
    _needs_pinned_memory(kind)
    bad, _ = KINDS[kind]
    register(_then_safe(bad), graph_safe=False)
    planner, table = _planner()
    step = next(s for s in planner.program(ForwardMode.DECODE).steps if s.key == KEY)
    assert not step.in_graph
    runner = GraphRunner(
        planner, lambda inputs, plans: plans[BACKEND].probe * 1, req_to_token=table, sizes=[2, 4]
    )
    runner.capture()
    assert runner.captured_sizes() == [2, 4] and not runner.stats.dropped
    batch = _batch(table, bs=3)
    out = runner.step(batch)
    assert torch.equal(out, batch.seq_lens_cpu + 1)


@pytest.mark.parametrize("kind", sorted(ALLOWED))
def test_graph_safe_code_passes_the_capture_and_replays_exactly(register, kind):
    register(_then_safe(ALLOWED[kind]))
    planner, table = _planner()
    graph = _capture(planner, table)
    batch = _batch(table)
    plans = planner.replay(batch, 2)
    graph.replay()
    assert torch.equal(plans[BACKEND].probe, batch.seq_lens_cpu + 1)
    _capture(planner, table, bs=4)  # another size's capture checks it again


def test_a_safe_provider_through_the_runner_replays_as_eager(register):
    register(_safe)
    planner, table = _planner()
    runner = GraphRunner(
        planner, lambda inputs, plans: plans[BACKEND].probe * 1, req_to_token=table, sizes=[4]
    )
    for bs in (1, 3, 4):
        batch = _batch(table, bs=bs)
        assert torch.equal(runner.step(batch), batch.seq_lens_cpu + 1)
    assert runner.stats.replays[("decode", 4)] == 3


def test_the_runner_fails_the_capture_instead_of_dropping_the_size(register):
    """A refused provider fails every size the same way: the runner raises it, as it does a
    forward whose outputs cannot be captured, rather than serve everything eagerly."""
    register(_then_safe(lambda x: x.tolist()))
    planner, table = _planner()
    runner = GraphRunner(
        planner, lambda inputs, plans: plans[BACKEND].probe * 1, req_to_token=table
    )
    with pytest.raises(GraphSafetyError, match=r"\.tolist\(\).*op 'graph_safety_probe'"):
        runner.capture()


def test_a_forward_outside_any_provider_is_named_by_its_function(register):
    """A model layer's sync has no op: the error names the function and line instead."""
    register(_safe)
    planner, table = _planner()

    def layer(inputs, plans):
        probe = plans[BACKEND].probe
        if probe.sum() > 0:  # bool(tensor) of a device value
            return probe * 1
        return probe * 0

    runner = GraphRunner(planner, layer, req_to_token=table, sizes=[2])
    with pytest.raises(GraphSafetyError) as caught:
        runner.capture()
    error = caught.value
    assert error.op is None and error.provider is None and error.field is None
    assert "bool(tensor)" in str(error) and error.where.endswith(".layer")
    assert "test_graph_safety.py:" in error.where


def test_the_running_provider_is_said_only_under_a_guard(register):
    """The planner sets nothing per provider call outside a guard (the replay hot path);
    under one, the provider running is known to the guard."""
    seen = []

    def provider(out, lens, **params):
        seen.append(running_provider())
        _safe(out, lens)

    register(provider)
    planner, table = _planner()
    planner.plan(_batch(table))
    _capture(planner, table)
    assert seen == [None, None, (KEY, OP, "torch")]
    assert running_provider() is None


def test_the_guard_is_off_after_a_capture_and_restores_from_numpy():
    real = torch.from_numpy
    with pytest.raises(GraphSafetyError), CaptureGuard():
        assert guarding() and capture_guarded() and torch.from_numpy is not real
        torch.arange(3).tolist()
    assert not guarding() and not capture_guarded() and torch.from_numpy is real
    assert torch.arange(3).tolist() == [0, 1, 2]  # outside: no mode, nothing refused


def test_every_refused_torch_callable_still_exists():
    """The guard's table names torch callables (``torch.Tensor.item``, ``torch.unique``...):
    a torch that renames one must fail here, not let the kind through unseen."""
    from graphs.capture_guard import _CHECKS

    names = {entry[0] for entry in _CHECKS.values()}
    for _, named in KINDS.values():
        if named in ("pin_memory=True", "torch.from_numpy", "__index__"):
            continue
        assert any(named in name for name in names), named
    assert all(callable(fn) for fn in _CHECKS)
