"""The model's extend and mixed forward is graph-safe: it runs under the CPU capture guard.

A CUDA graph of a ragged batch bakes in every host value the captured Python read. The
guard (``graphs.CaptureGuard``, what ``EmulatedGraph.capture`` runs under) refuses host
reads, data-dependent shapes and host-built tensors; these tests run the whole forward of
the tiny model (embedding, every layer's indexer with its static chunks, sparse MLA,
MoE, the head at ``logit_rows``) under it on eager plans of extend and mixed batches, and
check that what it computes is what the unguarded forward computes, that an emulated
capture's replay gives it again, and that a plan holding a capture's static width
(``max_seq_len`` a bound past the batch's, its chunk rows from it) gives the same logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.deepgemm import BLOCK_KV
from backends.nsa.extend_ops import indexer_chunk_rows
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import RequestPool
from dsv32_engine.models.layers.ffn import MoE
from dsv32_engine.models.model import DSV32Model
from graphs import CaptureGuard, EmulatedGraph, GraphSafetyError
from planner import ForwardBatch, ForwardMode, Limits, Planner
from planner.plans import PlanSet

CTX = 192
PAGES = -(-CTX // BLOCK_KV)
REQS = 4
BUDGET = 1 << 12  # bytes of logits a chunk may take: 4 rows of 256 columns, several chunks


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request) -> DSV32Model:
    return DSV32Model(DSV32Config.tiny(), seed=0, dtype=request.param)


def _planner(topk: int) -> Planner:
    limits = Limits(max_batch=REQS, max_context=CTX, num_sms=8, max_tokens=REQS * CTX)
    return Planner(["nsa"], limits, options={"nsa": {"topk": topk, "indexer_logits_bytes": BUDGET}})


def _batch(pool: RequestPool, rows: list[int], work: list[tuple[int, int]], mode: ForwardMode):
    """``work``: (KV length after this step, new tokens) per request."""
    table = pool.req_to_token
    locs = [table[r, p] for r, (n, e) in zip(rows, work) for p in range(n - e, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor([n for n, _ in work], dtype=torch.int32),
        req_pool_indices=torch.tensor(rows, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.stack(locs).to(torch.int32),
        mode=mode,
        extend_lens_cpu=torch.tensor([e for _, e in work], dtype=torch.int32),
    )


def _setup(model: DSV32Model, seed: int, mode: ForwardMode):
    """A cache whose requests hold random prefixes, and one extend or mixed batch over them."""
    rng = random.Random(seed)
    cache = model.new_cache(REQS * PAGES + 1)
    pool = RequestPool(REQS + 1, CTX, page_size=BLOCK_KV)
    rows = []
    for _ in range(REQS):
        row = pool.alloc()
        pool.assign(row, cache.alloc(PAGES), CTX)
        rows.append(row)
    planner = _planner(model.config.index_topk)
    # Fill every request's prefix with one whole-prompt extend (the cached KV).
    lens = [rng.randint(30, CTX - 40) for _ in rows]
    lens[1] = rng.randint(1, 8)  # its first new tokens fit in top-k: taken whole
    prefill = _batch(pool, rows, [(n, n) for n in lens], ForwardMode.EXTEND)
    ids = torch.randint(0, model.config.vocab_size, (sum(lens),))
    model(ids, planner.plan(prefill), cache)
    # The step under test: chunks after the prefix, decode rows in a mixed batch.
    new = [rng.randint(1, 40) for _ in rows]
    if mode is ForwardMode.MIXED:
        new[0] = new[2] = 1
    batch = _batch(pool, rows, [(n + e, e) for n, e in zip(lens, new)], mode)
    ids = torch.randint(0, model.config.vocab_size, (sum(new),))
    return planner, batch, ids, cache


def _widened(plans: PlanSet, width: int) -> dict:
    """The plans as a capture holds them: the NSA width the static bound, not the batch's."""
    nsa = plans["nsa"].model_copy(
        update={"max_seq_len": width, "indexer_chunk_rows": indexer_chunk_rows(width, BUDGET)}
    )
    return {**plans, "nsa": nsa}


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_extend_forward_runs_under_the_capture_guard(model, mode, hidden):
    planner, batch, ids, cache = _setup(model, 1, mode)
    plans = planner.plan(batch)
    nsa = plans["nsa"]
    assert plans.mode is mode and nsa.max_seq_len > nsa.topk  # the indexer scores tokens
    assert bool((nsa.kv_lens <= nsa.topk).any()) and bool((nsa.kv_lens > nsa.topk).any())
    assert nsa.positions.shape[0] > nsa.indexer_chunk_rows  # in more than one chunk
    assert any(isinstance(block.ffn, MoE) for block in model.layers)  # routed experts run
    eager = model(ids, plans, cache, hidden=hidden)
    with CaptureGuard():
        guarded = model(ids, plans, cache, hidden=hidden)
    if hidden:
        assert torch.equal(guarded["logits"], eager["logits"])
        assert torch.equal(guarded["hidden"], eager["hidden"])
    else:
        assert guarded.shape == (batch.bs, model.config.vocab_size)
        assert torch.equal(guarded, eager)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_an_emulated_capture_of_the_static_width_plan_replays_the_eager_logits(model, mode):
    """A capture's plan (a static width, here past ``max_context`` so that its chunks have
    fewer rows than the batch's own) selects what the batch's own plan selects, so its
    graph's replay gives the eager logits bit for bit."""
    planner, batch, ids, cache = _setup(model, 2, mode)
    plans = planner.plan(batch)
    eager = model(ids, plans, cache)
    static = _widened(plans, 2 * CTX)
    assert static["nsa"].indexer_chunk_rows < plans["nsa"].indexer_chunk_rows
    graph = EmulatedGraph()
    out = graph.capture(lambda: model(ids, static, cache))
    graph.replay()
    assert torch.equal(out, eager)


def test_the_guard_does_refuse_a_host_read_in_the_forward(model, monkeypatch):
    """The tests above can fail: a layer that reads a plan tensor on the host is refused."""
    from backends.nsa import extend_attention

    planner, batch, ids, cache = _setup(model, 3, ForwardMode.EXTEND)
    plans = planner.plan(batch)
    real = extend_attention.indexer_topk_extend

    def reads_lengths(plan, *args):
        plan.kv_lens.tolist()  # what the old host-walked chunks amounted to
        return real(plan, *args)

    monkeypatch.setattr("dsv32_engine.models.layers.indexer.indexer_topk_extend", reads_lengths)
    with pytest.raises(GraphSafetyError, match="tolist"), CaptureGuard():
        model(ids, plans, cache)
