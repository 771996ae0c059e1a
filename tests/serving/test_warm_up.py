"""The engine's warm-up: the prefill shapes a first request meets, on the null request only.

A Triton kernel compiles once per tile size and deep_gemm once per shape class, and
the tile sizes follow the rows. Whatever the first prefills meet and the warm-up did
not is compiled inside the first requests' time to first token (0.3-0.4 s on the
H200), so the warm-up runs those shapes itself, where nothing real is read or written.
"""

from __future__ import annotations

import torch

from planner.batch import ForwardMode
from tests.support.engines import tiny_engine


def test_warm_up_batches_cover_a_chunk_with_and_without_a_prefix():
    engine = tiny_engine(share_model=True)
    sched = engine.scheduler
    shapes = {
        (int(b.seq_lens_cpu[0]) - int(b.extend_lens_cpu[0]), int(b.extend_lens_cpu[0]))
        for b, _ in sched.warm_up_batches(topk=2048, chunk=2048, max_context=4352)
    }
    assert shapes == {(2048, 1), (0, 16), (0, 128), (2048, 128), (0, 2048), (2048, 2048)}
    # a short context keeps only what fits
    short = sched.warm_up_batches(topk=2048, chunk=2048, max_context=2100)
    assert all(int(b.seq_lens_cpu[0]) <= 2100 for b, _ in short)
    assert {int(b.extend_lens_cpu[0]) for b, _ in short} == {1, 16, 2048, 128}


def test_warm_up_touches_only_the_null_request_and_slot():
    engine = tiny_engine(share_model=True)
    batches = engine.scheduler.warm_up_batches(
        engine.model_config.index_topk, engine.config.loop.chunk_tokens, engine.limits.max_context
    )
    assert len(batches) >= 3
    for batch, ids in batches:
        assert batch.mode is ForwardMode.EXTEND
        assert batch.req_pool_indices.tolist() == [0]
        assert not batch.out_cache_loc.any()  # every token writes the null slot
        assert ids.numel() == batch.num_tokens
        assert batch.num_tokens <= engine.limits.max_tokens
        assert int(batch.seq_lens_cpu.max()) <= engine.limits.max_context
    pages, rows = engine.cache.num_free_pages, engine.pool.num_free
    engine.warm_up()
    assert (engine.cache.num_free_pages, engine.pool.num_free) == (pages, rows)
    assert torch.equal(engine.pool.req_to_token[0], torch.zeros_like(engine.pool.req_to_token[0]))


def test_warm_up_runs_every_batch_through_plan_and_forward(monkeypatch):
    engine = tiny_engine(share_model=True)
    planned = []
    plan = engine.planner.plan

    def spy(batch, *args, **kwargs):
        planned.append((int(batch.seq_lens_cpu[0]), batch.num_tokens))
        return plan(batch, *args, **kwargs)

    monkeypatch.setattr(engine.planner, "plan", spy)
    want = [
        (int(b.seq_lens_cpu[0]), b.num_tokens)
        for b, _ in engine.scheduler.warm_up_batches(
            engine.model_config.index_topk,
            engine.config.loop.chunk_tokens,
            engine.limits.max_context,
        )
    ]
    engine.warm_up()
    assert planned[: len(want)] == want


def test_a_graphs_warm_up_forward_runs_one_layer_of_each_kind():
    """After the first capture, a CUDA graph's warm-up runs the engine's forward over the
    model's first layer of each kind (tiny: the dense layer 0 and the MoE layer 1), the
    rest of the step unchanged."""
    engine = tiny_engine(share_model=True)
    batch, ids = engine.scheduler.warm_up_batches(
        engine.model_config.index_topk, engine.config.loop.chunk_tokens, 64
    )[0]
    plans = engine.planner.plan(batch)
    ran: list[int] = []
    hooks = [
        block.register_forward_hook(lambda _m, _a, _o, i=i: ran.append(i))
        for i, block in enumerate(engine.model.layers)
    ]
    try:
        cheap = engine.runner.warmup_forward({"input_ids": ids}, plans)
        assert ran == [0, 1]
        ran.clear()
        whole = engine.runner.forward({"input_ids": ids}, plans)
        assert ran == [0, 1, 2, 3]
    finally:
        for hook in hooks:
            hook.remove()
    assert cheap.keys() == whole.keys()
    assert all(cheap[k].shape == whole[k].shape for k in whole)
