"""The graph runner on the CPU (emulated graphs): same outputs as eager, padding that stays harmless."""

from __future__ import annotations

import contextlib
import gc
import random
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import (
    BATCH_TOO_LARGE,
    GRAPHS_DISABLED,
    MODE_NOT_CAPTURED,
    SIZE_DROPPED,
    EmulatedGraph,
    EmulatedPool,
    GraphOutputError,
    GraphRunner,
    GraphWarning,
    PulledTransport,
    capture_ladder,
    is_capturing,
)
from graphs import runner as runner_module
from graphs.emulated import POISON_INT
from planner import (
    BatchError,
    ConfigError,
    ForwardMode,
    PlanWriteError,
    ReplayError,
)
from tests.support.batches import make_pool
from tests.support.graph_model import Scheduler, TinyPagedModel
from tests.support.planners import PlannerSetup

PAGE, MAX_CTX, MAX_BATCH, NEXT_N = 4, 32, 12, 3
SIZES = [1, 2, 4, 8]  # batches of 9..12 exceed the largest size: eager fallbacks
POOL = 20
SLOTS = POOL * (MAX_CTX // PAGE) * PAGE
DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
TOL = {"rtol": 1e-5, "atol": 1e-6}
SETUP = PlannerSetup(("paged",), MAX_BATCH, MAX_CTX, PAGE, pool=POOL, limits={"next_n": NEXT_N})


def _setup(seed: int = 0, *, debug: bool = False, planner_kw: dict | None = None, **runner_kw):
    """A runner over a tiny model, its eager twin (own KV cache, own planner) and a scheduler."""
    table = make_pool(POOL, MAX_CTX, PAGE, seed=seed)
    model = TinyPagedModel(SLOTS, seed=seed)
    twin = model.clone_state()
    runner_kw.setdefault("sizes", SIZES)
    runner = GraphRunner(
        SETUP.planner(debug=debug, **(planner_kw or {})),
        model,
        req_to_token=table,
        static_inputs={"input_ids": torch.int64},
        **runner_kw,
    )
    return (
        runner,
        model,
        twin,
        SETUP.planner(debug=False),
        Scheduler(table, next_n=NEXT_N, seed=seed),
    )


def _check_equal(out: dict, want: dict, rows: int) -> None:
    assert out["meta"].shape[0] == rows and out["hidden"].shape[0] == rows
    assert torch.equal(out["meta"], want["meta"])  # every plan field, bit for bit
    # paged_attention computes in float32 over the plan's width (max_context when captured,
    # the batch's longest length when eager): equal up to float32 rounding, not bit for bit
    torch.testing.assert_close(out["hidden"], want["hidden"], **TOL)


# ---- capture sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_batch", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        (100, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]),
    ],
)
def test_default_capture_sizes(max_batch, expected):
    assert capture_ladder(max_batch) == expected


@given(st.integers(1, 4096))
def test_default_sizes_are_a_bounded_ladder(max_batch):
    sizes = capture_ladder(max_batch)
    assert sizes[0] == 1 and sizes[-1] == max_batch
    assert sizes == sorted(set(sizes))
    gaps = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert all(gap <= (8 if b <= 64 else 16) for gap, b in zip(gaps, sizes[1:], strict=True))


@pytest.mark.parametrize("bad", [[0], [1, 13], [4, 2], [2, 2], [], [1, "4"], [True], "1,2"])
def test_capture_size_override_is_validated(bad):
    with pytest.raises(ConfigError) as err:
        capture_ladder(MAX_BATCH, bad)
    assert err.value.field == "capture_sizes"


def test_capture_size_override_taken_as_written():
    assert capture_ladder(MAX_BATCH, [1, 3, 5]) == [1, 3, 5]
    with pytest.raises(ConfigError) as err:
        capture_ladder(0)
    assert err.value.field == "max_batch"


# ---- the emulated graph ----------------------------------------------------------------------


def test_emulated_graph_replays_into_the_captured_outputs():
    state = torch.zeros(3)
    seen = []

    def body():
        seen.append(is_capturing())
        return {"f": state * 2, "i": state.long() + 1}

    pool = EmulatedPool()
    graph = EmulatedGraph()
    with pytest.raises(RuntimeError):
        graph.replay()
    out = graph.capture(body, pool=pool)
    assert seen == [True] and not is_capturing()
    assert torch.isnan(out["f"]).all() and (out["i"] == POISON_INT).all()  # garbage until replay
    ptrs = (out["f"].data_ptr(), out["i"].data_ptr())
    for value in (1.0, 5.0):
        state.fill_(value)
        graph.replay()
        assert out["f"].tolist() == [2 * value] * 3 and out["i"].tolist() == [int(value) + 1] * 3
        assert (out["f"].data_ptr(), out["i"].data_ptr()) == ptrs
    assert seen == [True, False, False] and graph.pool() is pool and pool.graphs == 1
    with pytest.raises(RuntimeError):
        graph.capture(body)
    graph.reset()
    assert pool.graphs == 0


def test_emulated_graph_refuses_shape_changes():
    n = [2]
    graph = EmulatedGraph()
    graph.capture(lambda: torch.zeros(n[0]))
    n[0] = 3
    with pytest.raises(RuntimeError, match="shapes are fixed"):
        graph.replay()


# ---- the runner against eager ----------------------------------------------------------------


def test_thousand_random_steps_equal_eager():
    """Decode and verify, sizes 1..12 (9..12 beyond the largest graph), debug verify on."""
    runner, model, twin, ref, sched = _setup(seed=11, debug=True)
    rng = random.Random(11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(1000):
            mode = rng.choice([DECODE, VERIFY])
            batch, inputs = sched.batch(rng.randint(1, MAX_BATCH), mode)
            out = runner.step(batch, inputs)
            want = twin(inputs, ref.plan(batch))
            _check_equal(out, want, batch.bs * batch.next_n)
    # every real KV slot was written identically; slot 0 is the null slot padding writes
    torch.testing.assert_close(model.k_cache[:, 1:], twin.k_cache[:, 1:], **TOL)
    torch.testing.assert_close(model.v_cache[:, 1:], twin.v_cache[:, 1:], **TOL)
    stats = runner.stats
    assert stats.steps == 1000 and set(stats.eager) == {BATCH_TOO_LARGE}
    assert stats.graph_steps + stats.eager[BATCH_TOO_LARGE] == 1000
    assert {bs for _, bs in stats.replays} == set(SIZES)
    assert runner.planner.stats.verified == stats.graph_steps
    assert stats.captured == {"decode": SIZES, "target_verify": SIZES} and not stats.dropped
    fallbacks = [w for w in caught if issubclass(w.category, GraphWarning)]
    assert len(fallbacks) == 1 and BATCH_TOO_LARGE in str(fallbacks[0].message)


def test_the_first_warm_up_runs_the_whole_forward_later_ones_the_cheap_one():
    """``warmup_forward``: every capture after the first warms up on it (the first on the
    whole forward, so a layer's first-call state is made outside any capture); captures
    and replays run the forward itself, equal to eager."""
    runner, model, twin, ref, sched = _setup(seed=3, modes=[DECODE], warmup_runs=1)
    calls: list[str] = []

    def spy(kind: str):
        def forward(inputs, plans):
            seen = "capture" if is_capturing() else kind
            calls.append(f"{seen} {plans.mode.value}/{plans.reqs}")
            return model(inputs, plans)

        return forward

    runner.forward, runner.warmup_forward = spy("whole"), spy("cheap")
    runner.capture()
    assert calls == [
        "whole decode/8",
        "capture decode/8",
        *(f"{kind} decode/{bs}" for bs in (4, 2, 1) for kind in ("cheap", "capture")),
    ]
    for bs in (3, 8, 1):
        batch, inputs = sched.batch(bs, DECODE)
        _check_equal(runner.step(batch, inputs), twin(inputs, ref.plan(batch)), bs)


def test_no_garbage_is_collected_inside_a_capture():
    """A collection inside a capture can free a dead runner's graphs, an illegal call there
    (``graphs.graph.no_collection``): cyclic garbage made during one capture, where every
    allocation would start a collection, is freed only outside any capture."""
    runner, model, *_ = _setup(modes=[DECODE])
    freed_inside: list[bool] = []

    class Dead:
        def __del__(self):
            freed_inside.append(is_capturing())

    def churn(inputs, plans):
        if is_capturing():
            dead = Dead()
            dead.cycle = dead  # garbage only the collector frees
            del dead
            thresholds = gc.get_threshold()  # every allocation a collection, where one can run
            gc.set_threshold(1, 1, 1)
            _ = [[] for _ in range(10)]
            gc.set_threshold(*thresholds)
        return model(inputs, plans)

    runner.forward = churn
    was_enabled = gc.isenabled()
    runner.capture()
    gc.collect()
    assert freed_inside == [False] * len(SIZES)
    assert gc.isenabled() == was_enabled


@pytest.mark.parametrize("ops_in_graph", [True, False])
def test_host_ops_path_equals_eager(ops_in_graph):
    """With ops outside the graph, replay itself refreshes every field; same outputs."""
    runner, _, twin, ref, sched = _setup(
        seed=3, planner_kw={"ops_in_graph": ops_in_graph}, sizes=[2, 4, 12]
    )
    rng = random.Random(3)
    for _ in range(40):
        batch, inputs = sched.batch(rng.randint(1, MAX_BATCH), rng.choice([DECODE, VERIFY]))
        _check_equal(
            runner.step(batch, inputs), twin(inputs, ref.plan(batch)), batch.bs * batch.next_n
        )
    assert runner.stats.graph_steps == 40


def test_staging_in_the_graph_equals_eager():
    """The graph pulls its inputs itself: every step's outputs are still eager's, and each
    replayed step was pulled once (decode and verify each keep their own ring)."""
    runner, _, twin, ref, sched = _setup(seed=5, planner_kw={"transport": PulledTransport})
    rng = random.Random(5)
    for _ in range(300):
        batch, inputs = sched.batch(rng.randint(1, 8), rng.choice([DECODE, VERIFY]))
        _check_equal(
            runner.step(batch, inputs), twin(inputs, ref.plan(batch)), batch.bs * batch.next_n
        )
    pulled = {}
    for (mode, _), captured in runner.planner._captured.items():
        pulled[mode] = captured.stager.transport.ring.seq
    replays = {m: 0 for m in (DECODE.value, VERIFY.value)}
    for (mode, _), count in runner.stats.replays.items():
        replays[mode] += count
    assert {m.value: n for m, n in pulled.items()} == replays
    assert sum(replays.values()) == 300


def test_padding_rows_write_only_the_null_slot():
    runner, model, _, _, sched = _setup(seed=5)
    rng = random.Random(5)
    sentinel = 1e6  # finite: masked reads of slot 0 weigh it by exactly 0
    padded_steps = 0
    for _ in range(60):
        mode = rng.choice([DECODE, VERIFY])
        batch, inputs = sched.batch(rng.choice([1, 3, 5, 6, 7]), mode)
        model.k_cache[:, 0] = sentinel
        before = model.k_cache.clone()
        out = runner.step(batch, inputs)
        rows = batch.bs * batch.next_n
        assert out["hidden"].shape[0] == rows and out["meta"].shape[0] == rows
        assert (
            out["meta"][:, 1].tolist()
            == batch.req_pool_indices.repeat_interleave(batch.next_n).tolist()
        )
        changed = (model.k_cache != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        real = set(batch.out_cache_loc.tolist())
        assert set(changed) - {0} <= real and 0 not in real
        padded = runner.route(mode, batch.bs)[0] > batch.bs
        assert (0 in changed) == padded  # padding rows land on the null slot, and only they do
        padded_steps += padded
    assert padded_steps > 20
    assert runner.stats.padded_rows > 0


def test_outputs_are_graph_memory_sliced_to_real_rows():
    runner, _, twin, ref, sched = _setup(seed=2)
    ptrs = set()
    for bs, mode in [(3, DECODE), (4, DECODE), (3, DECODE), (2, VERIFY), (1, VERIFY)]:
        batch, inputs = sched.batch(bs, mode)
        out = runner.step(batch, inputs)
        rows = bs * batch.next_n
        _check_equal(out, twin(inputs, ref.plan(batch)), rows)
        assert runner.last_plans.phase != "eager" and runner.last_plans.real_reqs == bs
        if mode is DECODE:
            ptrs.add(out["hidden"].data_ptr())
    assert len(ptrs) == 1  # decode batches of 3 and 4 both replay the size-4 graph's outputs
    assert runner.stats.replays == {
        ("decode", 4): 3,
        ("target_verify", 2): 1,
        ("target_verify", 1): 1,
    }


# ---- failures, fallbacks, debug --------------------------------------------------------------


def test_failed_capture_is_dropped_once_and_others_keep_working():
    table = SETUP.table
    model = TinyPagedModel(SLOTS)
    twin = model.clone_state()

    def flaky(inputs, plans):
        if is_capturing() and plans.mode is DECODE and plans.reqs == 4:
            raise RuntimeError("capture exploded")
        return model(inputs, plans)

    def warmup(planner, bs):
        if bs == 2:
            raise RuntimeError("JIT warm-up failed")

    runner = GraphRunner(
        SETUP.planner(debug=False),
        flaky,
        req_to_token=table,
        static_inputs={"input_ids": torch.int64},
        sizes=SIZES,
        warmup=warmup,
    )
    with pytest.warns(GraphWarning) as caught:
        stats = runner.capture()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3  # decode 4, decode 2, verify 2: each reported once
    assert (
        stats.dropped["decode"].keys() == {2, 4}
        and "capture exploded" in stats.dropped["decode"][4]
    )
    assert stats.dropped["target_verify"].keys() == {2}
    assert runner.captured_sizes(DECODE) == [1, 8] and runner.captured_sizes(VERIFY) == [1, 4, 8]
    ref, sched = SETUP.planner(debug=False), Scheduler(table, next_n=NEXT_N, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no repeated report
        for bs, mode in [
            (3, DECODE),
            (4, DECODE),
            (2, DECODE),
            (1, DECODE),
            (2, VERIFY),
            (8, DECODE),
        ]:
            batch, inputs = sched.batch(bs, mode)
            _check_equal(
                runner.step(batch, inputs), twin(inputs, ref.plan(batch)), bs * batch.next_n
            )
    assert (
        runner.stats.replays[("decode", 8)] == 4 and runner.stats.replays[("target_verify", 4)] == 1
    )
    assert "dropped decode/4" in runner.stats.render()


def test_dropped_largest_size_falls_back_with_its_own_reason():
    def warmup(planner, bs):
        if bs == 8:
            raise RuntimeError("out of memory")

    runner, _, twin, ref, sched = _setup(warmup=warmup)
    with pytest.warns(GraphWarning):
        runner.capture()
    batch, inputs = sched.batch(6, DECODE)
    with pytest.warns(GraphWarning, match=SIZE_DROPPED):
        out = runner.step(batch, inputs)
    _check_equal(out, twin(inputs, ref.plan(batch)), 6)
    assert runner.stats.eager == {SIZE_DROPPED: 1}


def test_fallback_reasons_are_counted_and_warned_once():
    runner, _, twin, ref, sched = _setup(modes=[DECODE])
    for reason, bs, mode in [(MODE_NOT_CAPTURED, 2, VERIFY), (BATCH_TOO_LARGE, 10, DECODE)]:
        with pytest.warns(GraphWarning, match=reason):
            batch, inputs = sched.batch(bs, mode)
            _check_equal(
                runner.step(batch, inputs), twin(inputs, ref.plan(batch)), bs * batch.next_n
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batch, inputs = sched.batch(bs, mode)
            _check_equal(
                runner.step(batch, inputs), twin(inputs, ref.plan(batch)), bs * batch.next_n
            )
    assert runner.stats.eager == {MODE_NOT_CAPTURED: 2, BATCH_TOO_LARGE: 2}

    # graphs off is what the caller asked for: eager, counted, never warned
    off, _, twin, ref, sched = _setup(enabled=False)
    batch, inputs = sched.batch(3, DECODE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_equal(off.step(batch, inputs), twin(inputs, ref.plan(batch)), 3)
    assert off.stats.eager == {GRAPHS_DISABLED: 1}
    assert off.stats.kind == "off" and off.stats.captured == {} and off.inputs.nbytes == 0


def test_debug_mode_catches_a_layer_writing_a_plan():
    table = SETUP.table
    model = TinyPagedModel(SLOTS)

    def vandal(inputs, plans):
        out = model(inputs, plans)
        if plans.phase != "capture":  # a write at capture is refused, debug or not
            plans["paged"].kv_lens.add_(1)  # a layer must only read plans
        return out

    runner = GraphRunner(
        SETUP.planner(debug=True),
        vandal,
        req_to_token=table,
        static_inputs={"input_ids": torch.int64},
        sizes=[4],
    )
    sched = Scheduler(table, next_n=NEXT_N, seed=0)
    batch, inputs = sched.batch(3, DECODE)
    with pytest.raises(ReplayError, match="kv_lens"):
        runner.step(batch, inputs)
    batch, inputs = sched.batch(6, DECODE)
    with pytest.warns(GraphWarning), pytest.raises(PlanWriteError):
        runner.step(batch, inputs)


def test_inputs_and_config_are_validated():
    runner, _, _, _, sched = _setup()
    batch, inputs = sched.batch(3, DECODE)
    for bad, field in [
        ({}, "inputs"),
        ({**inputs, "extra": inputs["input_ids"]}, "inputs"),
        ({"input_ids": inputs["input_ids"][:2]}, "inputs.input_ids"),
        ({"input_ids": inputs["input_ids"].int()}, "inputs.input_ids"),
    ]:
        with pytest.raises(BatchError) as err:
            runner.step(batch, bad)
        assert err.value.field == field
    with pytest.raises(BatchError):
        runner.step("not a batch", inputs)
    table = SETUP.table
    with pytest.raises(ConfigError) as err:
        GraphRunner(
            SETUP.planner(debug=False), lambda i, p: i, req_to_token=table, use_cuda_graph=True
        )
    assert err.value.field == "use_cuda_graph"
    with pytest.raises(ConfigError) as err:
        GraphRunner(
            SETUP.planner(debug=False), lambda i, p: i, req_to_token=table, modes=["prefill"]
        )
    assert err.value.field == "modes"
    with pytest.raises(ConfigError) as err:
        GraphRunner(SETUP.planner(debug=False), lambda i, p: i, req_to_token=table, sizes=[16])
    assert err.value.field == "capture_sizes"


@pytest.mark.parametrize("result", [lambda: 3, lambda: torch.zeros(()), lambda: torch.zeros(5, 2)])
def test_unsliceable_outputs_raise_instead_of_dropping_every_size(result):
    table = SETUP.table
    runner = GraphRunner(
        SETUP.planner(debug=False), lambda inputs, plans: result(), req_to_token=table, sizes=[2, 4]
    )
    with pytest.raises(GraphOutputError):
        runner.capture()


def test_stats_summary_and_table():
    runner, _, _, _, sched = _setup(sizes=[2, 4])
    rng = random.Random(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        for _ in range(10):
            batch, inputs = sched.batch(rng.randint(1, 6), rng.choice([DECODE, VERIFY]))
            runner.step(batch, inputs)
    summary = runner.stats.summary()
    assert summary["kind"] == "emulated" and summary["graphs"] == 4
    assert summary["pool_allocated_bytes"] is None and summary["pool_reserved_bytes"] is None
    assert summary["planner_static_bytes"] == runner.planner.static_bytes() > 0
    assert summary["input_bytes"] == 4 * NEXT_N * 8  # int64 input_ids for 4 verify requests
    assert (
        summary["steps"] == 10 == summary["graph_steps"] + sum(summary["eager_fallbacks"].values())
    )
    assert summary["host_seconds"]["refresh"] > 0 and summary["host_seconds"]["replay"] > 0
    text = runner.stats.render()
    assert "captured decode" in text and "2, 4" in text and "graph hit rate" in text
    runner.stats.reset_counters()
    assert runner.stats.steps == 0 and runner.stats.captured == {
        "decode": [2, 4],
        "target_verify": [2, 4],
    }
    runner.close()
    assert runner.captured_sizes(DECODE) == []


# ---- the CUDA adapter's failure path, with torch.cuda faked ------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """Just enough of torch.cuda to drive CudaGraph and the recovery on the CPU; logs calls."""
    from contextlib import contextmanager

    calls = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "default-stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: calls.append(("set_stream", s)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch._C,
        "_cuda_endAllocateToPool",
        lambda dev, pool: calls.append(("end", dev, pool)),
        raising=False,
    )

    @contextmanager
    def fake_graph(g, pool=None, stream=None):
        calls.append(("begin", pool))
        yield  # like torch.cuda.graph: an exception in the body skips the stream restore

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    return calls


def test_cuda_adapter_restores_the_stream_after_a_failed_capture(fake_cuda):
    from graphs.graph import CudaGraph

    adapter = CudaGraph()
    assert adapter.capture(lambda: "out", pool=(0, 7)) == "out"
    assert fake_cuda == [("begin", (0, 7)), ("set_stream", "default-stream")]
    fake_cuda.clear()

    def sync_in_capture():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        CudaGraph().capture(sync_in_capture, pool=(0, 7))
    assert fake_cuda == [("begin", (0, 7)), ("set_stream", "default-stream")]


@pytest.mark.parametrize("allocator_left_capturing", [False, True])
def test_recovery_ends_the_pool_capture_only_when_torch_did_not(
    fake_cuda, monkeypatch, allocator_left_capturing
):
    from graphs.graph import recover_after_failed_capture

    state = {"capturing": allocator_left_capturing}

    def empty_cache():
        fake_cuda.append(("empty_cache",))
        if state["capturing"]:
            raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED at ...")

    def end(dev, pool):
        fake_cuda.append(("end", dev, pool))
        state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    recover_after_failed_capture((0, 7))
    if allocator_left_capturing:
        assert fake_cuda == [("empty_cache",), ("end", 0, (0, 7)), ("empty_cache",)]
    else:
        assert fake_cuda == [("empty_cache",)]


def test_replay_overhead_benchmark_runs_on_emulated_graphs(tmp_path):
    """A smoke run on the CPU, so the GPU script cannot rot between GPU sessions."""
    import json

    from benchmarks.host import replay_overhead as bench

    out = tmp_path / "r.json"
    args = ["--device", "cpu", "--batches", "1", "4", "--iters", "3", "--warmup", "1"]
    args += ["--max-context", "256", "--backends", "paged", "--out", str(out)]
    result = bench.run(args)
    saved = json.loads(out.read_text())
    rows = [(r["bs"], r["staging"]) for r in saved["rows"]]
    assert rows == [(bs, staging) for bs in (1, 4) for staging in ("slot", "graph", "copy")]
    assert [r["bs"] for r in saved["rows"]] == [r["graph_size"] for r in result["rows"]]
    assert all(g["eager_fallbacks"] == {} for g in saved["graphs"].values())
    assert saved["graph_kind"] == "emulated"
    assert all(r["refresh"]["p50"] > 0 for r in saved["rows"])


def test_warm_up_runs_on_the_stream_the_graph_is_captured_on(monkeypatch):
    """Every warm-up forward runs inside ``on_capture_stream`` of the capture's stream (the
    emulation's is None): cuBLAS makes its per-stream state on a stream's first GEMM, which
    must not come inside a capture."""
    inside: list[bool] = []
    depth = [0]

    @contextlib.contextmanager
    def recording(stream):
        depth[0] += 1
        yield
        depth[0] -= 1

    monkeypatch.setattr(runner_module, "on_capture_stream", recording)
    runner, *_ = _setup(warmup_runs=1)
    forward = runner.forward
    runner.forward = lambda inputs, plans: (inside.append(depth[0] > 0), forward(inputs, plans))[1]
    runner.warmup_forward = runner.forward
    runner.capture()
    # per size: its warm-up forward inside, then the capture's own forward outside
    assert inside == [True, False] * len(runner.stats.capture_costs)
