"""The graph runner with real ``torch.cuda.CUDAGraph``: what the CPU emulation cannot prove.

Bit-equal integer metadata after every replay, outputs equal to eager within
float tolerance, pool memory reported, default capture sizes up to 256 in
both modes without running out of memory, and recovery from a capture that
CUDA itself invalidates (a host sync inside the graph).
"""

from __future__ import annotations

import gc
import random
import warnings

import pytest
import torch

from graphs import GraphRunner, GraphWarning, capture_ladder, is_capturing
from planner import ForwardMode, Limits, Planner
from tests.support.batches import make_pool
from tests.support.graph_model import Scheduler, TinyPagedModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
PAGE, NEXT_N = 16, 2
TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32; eager plans are narrower than captured ones


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """TF32 would make eager and graph differ by more than shape-dependent rounding."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _setup(
    max_batch: int,
    max_context: int,
    *,
    seed: int = 0,
    debug: bool = False,
    forward=None,
    table: torch.Tensor | None = None,
    planner_kw: dict | None = None,
    **kw,
):
    """Runner, its model, the eager twin (own KV cache), an eager planner, a scheduler.

    Runners compared on one batch stream must share ``table``: a graph binds its address.
    """
    pool = max_batch + 4
    if table is None:
        table = make_pool(pool, max_context, PAGE, seed=seed).cuda()
    slots = pool * (-(-max_context // PAGE)) * PAGE
    model = TinyPagedModel(
        slots, heads=4, kv_heads=2, dim=16, dtype=torch.float32, device="cuda", seed=seed
    )
    twin = model.clone_state()
    limits = Limits(
        max_batch=max_batch, max_context=max_context, page_size=PAGE, next_n=NEXT_N, device="cuda"
    )
    runner = GraphRunner(
        Planner(["paged"], limits, debug=debug, **(planner_kw or {})),
        forward or model,
        req_to_token=table,
        static_inputs={"input_ids": torch.int64},
        **kw,
    )
    ref = Planner(["paged"], limits)
    return runner, model, twin, ref, Scheduler(table, next_n=NEXT_N, seed=seed)


def _check_step(runner, twin, ref, batch, inputs) -> None:
    """Integer metadata bit-equal to an eager plan of the padded batch; outputs close to eager."""
    out = runner.step(batch, inputs)
    rows = batch.bs * batch.next_n
    size, _ = runner.route(ForwardMode(batch.mode), batch.bs)
    if size is not None:
        padded = ref.plan(batch, pad_to=size)["paged"]
        for name, tensor in runner.last_plans["paged"].tensors().items():
            assert torch.equal(tensor, getattr(padded, name)), name
    want = twin(inputs, ref.plan(batch))
    assert out["hidden"].shape[0] == rows and out["meta"].shape[0] == rows
    assert torch.equal(out["meta"], want["meta"])
    torch.testing.assert_close(out["hidden"], want["hidden"], **TOL)


def test_cuda_graphs_equal_eager_over_random_steps():
    runner, model, twin, ref, sched = _setup(
        48, 256, seed=1, debug=True, sizes=[1, 2, 4, 8, 16, 32]
    )
    rng = random.Random(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # 33..48 fall back, on purpose
        for _ in range(400):
            batch, inputs = sched.batch(rng.randint(1, 48), rng.choice([DECODE, VERIFY]), "cuda")
            _check_step(runner, twin, ref, batch, inputs)
    torch.testing.assert_close(model.k_cache[:, 1:], twin.k_cache[:, 1:], **TOL)
    torch.testing.assert_close(model.v_cache[:, 1:], twin.v_cache[:, 1:], **TOL)
    stats = runner.stats
    assert stats.kind == "cuda" and not stats.dropped
    assert stats.pool_allocated_bytes > 0 and stats.pool_reserved_bytes > 0
    assert runner.planner.stats.verified == stats.graph_steps > 200  # ~2/3 of 400 fit
    assert set(stats.eager) == {"batch_too_large"}
    print(stats.render())


def test_outputs_keep_their_storage_and_match_the_emulation():
    cuda, _, _, _, sched = _setup(16, 128, seed=2, sizes=[4, 8, 16])
    emul, _, _, _, _ = _setup(
        16, 128, seed=2, sizes=[4, 8, 16], use_cuda_graph=False, table=cuda.req_to_token
    )
    assert cuda.kind == "cuda" and emul.kind == "emulated"
    rng = random.Random(2)
    ptrs = {}
    for _ in range(50):
        batch, inputs = sched.batch(rng.randint(1, 16), rng.choice([DECODE, VERIFY]), "cuda")
        got, want = cuda.step(batch, inputs), emul.step(batch, inputs)
        assert torch.equal(got["meta"], want["meta"])
        torch.testing.assert_close(got["hidden"], want["hidden"], rtol=1e-5, atol=1e-5)
        key = (batch.mode, cuda.route(ForwardMode(batch.mode), batch.bs)[0])
        assert ptrs.setdefault(key, got["hidden"].data_ptr()) == got["hidden"].data_ptr()


def test_default_sizes_up_to_256_capture_without_oom():
    torch.cuda.reset_peak_memory_stats()
    runner, _, twin, ref, sched = _setup(256, 1024, seed=3)
    stats = runner.capture()
    assert runner.captured_sizes(DECODE) == capture_ladder(256) == runner.captured_sizes(VERIFY)
    assert not stats.dropped and stats.pool_reserved_bytes > 0
    for bs, mode in [
        (1, DECODE),
        (64, DECODE),
        (200, DECODE),
        (256, DECODE),
        (1, VERIFY),
        (256, VERIFY),
    ]:
        batch, inputs = sched.batch(bs, mode, "cuda")
        _check_step(runner, twin, ref, batch, inputs)
    print(stats.render(), f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


def test_a_sync_inside_capture_drops_only_that_size():
    """CUDA invalidates the capture; the runner must leave torch able to capture the next size."""
    holder = {}

    def syncing(inputs, plans):
        if is_capturing() and plans.mode is DECODE and plans.reqs == 4:
            plans["paged"].seq_lens.sum().item()  # a host sync: illegal while capturing
        return holder["model"](inputs, plans)

    runner, model, twin, ref, sched = _setup(8, 128, seed=4, forward=syncing, sizes=[1, 2, 4, 8])
    holder["model"] = model
    with pytest.warns(GraphWarning, match="batch size 4"):
        stats = runner.capture()
    assert list(stats.dropped) == ["decode"] and list(stats.dropped["decode"]) == [4]
    assert runner.captured_sizes(DECODE) == [1, 2, 8]  # 2 and 1 were captured after the failure
    assert runner.captured_sizes(VERIFY) == [1, 2, 4, 8]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.cuda.empty_cache()  # would hit captures_underway.empty() if the allocator were left capturing
    for bs, mode in [(3, DECODE), (4, DECODE), (2, DECODE), (4, VERIFY)]:
        batch, inputs = sched.batch(bs, mode, "cuda")
        _check_step(runner, twin, ref, batch, inputs)
    assert runner.stats.replays[("decode", 8)] == 2


def test_a_dead_runners_graphs_are_not_freed_inside_another_capture():
    """A runner in a reference cycle (as an engine holds it) is freed by the collector; if a
    collection ran inside another runner's capture, destroying its graphs would invalidate
    that capture (global capture mode) and drop the size. The runner collects before its
    captures and none runs inside one (``graphs.graph.no_collection``)."""
    dead, *_ = _setup(8, 64, sizes=[1, 2, 4, 8])
    dead.capture()
    dead.cycle = dead  # freed only by the collector
    del dead
    runner, model, twin, ref, sched = _setup(8, 64, seed=1, sizes=[1, 2, 4, 8])

    def churn(inputs, plans):
        if is_capturing():  # every allocation a full collection, where collections can run
            thresholds = gc.get_threshold()
            gc.set_threshold(1, 1, 1)
            _ = [[] for _ in range(10)]
            gc.set_threshold(*thresholds)
        return model(inputs, plans)

    runner.forward = runner.warmup_forward = churn
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        runner.capture()
    assert not runner.stats.dropped
    batch, inputs = sched.batch(3, DECODE)
    _check_step(runner, twin, ref, batch, inputs)
