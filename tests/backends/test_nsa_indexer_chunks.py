"""The extend indexer's static chunking: same top-k as the old per-batch chunking, shapes only.

The old indexer cut the tokens it scored (causal KV > top-k) into chunks on the host from
the batch's lengths, each as wide as its widest row, and took every other token whole. The
static one scores every token in chunks of ``indexer_chunk_rows`` rows ``max_seq_len``
wide, cut from the token count alone, and keeps the whole path per row. ``old_topk`` below
is the old selection, kept here as the exact reference: on random batches (and with the
width raised to a static bound, as in a captured plan) the new one returns the same slots
bit for bit, and under the CPU capture guard it reads nothing on the host.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.deepgemm import fp8, fp8_mqa_logits, gather_index_cache
from backends.nsa import extend_attention
from backends.nsa.extend_attention import indexer_topk_extend
from backends.nsa.extend_ops import (
    ROW_ALIGN,
    indexer_chunk_bounds,
    indexer_chunk_rows,
    indexer_row_bytes,
)
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.topk import row_topk
from graphs import CaptureGuard
from planner import ForwardBatch, ForwardMode, Limits, Planner
from planner.ops import all_ops
from tests.support.batches import make_pool

MAX_BATCH, MAX_CTX, PAGE, HEADS, DIM = 5, 320, 64, 4, 32
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=3)
BLOCKS = int(TABLE.max()) // PAGE + 1


def greedy(seq: list[int], new: list[int], topk: int, budget: int) -> list[tuple[int, int, int]]:
    """The old host chunking: walk the tokens in order; a chunk grows while its rows (as wide
    as the widest, padded to 256 columns, 4 bytes each) fit the budget, and ends at a token
    taken whole. ``(first, end, width)`` per chunk."""
    causal = [n - e + i + 1 for n, e in zip(seq, new) for i in range(e)]
    chunks, open_ = [], None  # open_: [first, end, width]
    for t, c in enumerate(causal):
        if c <= topk:
            if open_:
                chunks.append(tuple(open_))
            open_ = None
            continue
        if open_:
            width = max(open_[2], c)
            rows = t + 1 - open_[0]
            if rows * (-(-width // ROW_ALIGN) * ROW_ALIGN) * 4 <= budget:
                open_[1], open_[2] = t + 1, width
                continue
            chunks.append(tuple(open_))
        open_ = [t, t + 1, c]
    if open_:
        chunks.append(tuple(open_))
    return chunks


def old_topk(plan: NSAExtendPlan, batch: ForwardBatch, q, w, cache, budget: int) -> torch.Tensor:
    """The old indexer's selection, exactly: whole rows first, then the greedy chunks scored
    with the chunk's own width, their rows overwritten with their top-k slots."""
    seq, new = batch.seq_lens_cpu.tolist(), batch.extend_lens_cpu.tolist()
    topk, slots = plan.topk, plan.kv_slots
    ks, ke = plan.kv_ranges[0], plan.kv_ranges[1]
    col = torch.arange(topk)
    whole = torch.where(
        col < plan.topk_lens[:, None],
        slots[(ks[:, None] + col).clamp(max=slots.shape[0] - 1).long()],
        -1,
    )
    keys = gather_index_cache(cache, slots)
    for first, end, width in greedy(seq, new, topk, budget):
        logits = fp8_mqa_logits(
            q[first:end].contiguous(),
            keys,
            w[first:end].contiguous(),
            ks[first:end].contiguous(),
            ke[first:end].contiguous(),
            max_seqlen_k=width,
        )
        best = torch.empty(end - first, topk, dtype=torch.int32)
        row_topk(logits, (ke[first:end] - ks[first:end]).contiguous(), topk, best)
        rows = (ks[first:end, None] + best.clamp(min=0)).clamp(max=slots.shape[0] - 1)
        whole[first:end] = torch.where(best >= 0, slots[rows.long()], -1)
    return whole.to(torch.int32)


def planner(topk: int, budget: int) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        num_sms=8,
        kv_slots=int(TABLE.max()) + 1,
        max_tokens=MAX_BATCH * MAX_CTX,
    )
    options = {"nsa": {"topk": topk, "indexer_logits_bytes": budget}}
    return Planner(["nsa"], limits, options=options)


def extend_batch(rng: random.Random, mode: ForwardMode, max_new: int) -> ForwardBatch:
    """Random requests, each adding 1..max_new tokens after a random cached prefix; a mixed
    batch has one-token (decode) requests among them."""
    bs = rng.randint(1, MAX_BATCH)
    pools = rng.sample(range(1, TABLE.shape[0]), bs)
    lens = [rng.randint(1, MAX_CTX) for _ in range(bs)]
    new = [rng.randint(1, min(n, max_new)) for n in lens]
    if mode is ForwardMode.MIXED:
        for b in range(0, bs, 2):
            new[b] = 1
    locs = [int(TABLE[p, q]) for p, n, e in zip(pools, lens, new) for q in range(n - e, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(pools, dtype=torch.int32),
        req_to_token=TABLE,
        out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        mode=mode,
        extend_lens_cpu=torch.tensor(new, dtype=torch.int32),
    )


def indexer_inputs(seed: int, tokens: int, ties: bool):
    """Random fp8 queries, weights and a filled index cache. ``ties``: small integer keys and
    queries, so many scores tie exactly and the tie rule (lowest position) is exercised."""
    gen = torch.Generator().manual_seed(seed)
    cache = fp8.new_index_cache(BLOCKS, DIM)
    slots = torch.arange(BLOCKS * PAGE, dtype=torch.int32)
    if ties:
        k = torch.randint(-1, 2, (slots.shape[0], DIM), generator=gen).float()
        q = torch.randint(-1, 2, (tokens, HEADS, DIM), generator=gen).float()
    else:
        k = torch.randn(slots.shape[0], DIM, generator=gen)
        q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k_fp8, k_scale = fp8.quantize_fp8_e4m3_per_vector(k, block=DIM)
    fp8.write_index_cache(cache, slots, k_fp8, k_scale)
    q_fp8, _ = fp8.quantize_fp8_e4m3_per_vector(q, block=DIM)
    w = torch.rand(tokens, HEADS, generator=gen)
    return q_fp8, w, cache


def widened(plan: NSAExtendPlan, width: int, budget: int) -> NSAExtendPlan:
    """The plan as a capture would hold it: ``max_seq_len`` the static bound, not the batch's."""
    return plan.model_copy(
        update={"max_seq_len": width, "indexer_chunk_rows": indexer_chunk_rows(width, budget)}
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from([ForwardMode.EXTEND, ForwardMode.MIXED]),
    topk=st.sampled_from([1, 8, 64, 256]),
    budget=st.sampled_from([1, 1 << 12, 3 << 12, 1 << 14, 1 << 30]),
    max_new=st.sampled_from([1, 8, 40, MAX_CTX]),
    ties=st.booleans(),
    static=st.booleans(),
)
def test_static_chunks_select_what_the_old_chunks_selected(
    seed, mode, topk, budget, max_new, ties, static
):
    batch = extend_batch(random.Random(seed), mode, max_new)
    plan = planner(topk, budget).plan(batch)["nsa"]
    tokens = plan.positions.shape[0]
    q, w, cache = indexer_inputs(seed, tokens, ties)
    want = old_topk(plan, batch, q, w, cache, budget)
    if static:  # a captured plan's width: the static bound, wider than any request
        plan = widened(plan, MAX_CTX + 17, budget)
    got = indexer_topk_extend(plan, q, w, cache)
    assert got.dtype == torch.int32 and got.shape == (tokens, topk)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(12))
def test_chunks_come_from_the_token_count_and_plan_scalars(seed, monkeypatch):
    """The layer scores ceil(tokens / C) chunks of C rows (the last shorter), each
    ``max_seq_len`` wide, C from ``max_seq_len`` and the budget alone; none when the longest
    KV fits in top-k."""
    rng = random.Random(seed)
    topk = rng.choice([4, 16, 64])
    budget = rng.choice([1, 1 << 12, 1 << 14, 1 << 30])
    batch = extend_batch(rng, rng.choice([ForwardMode.EXTEND, ForwardMode.MIXED]), 40)
    plan = planner(topk, budget).plan(batch)["nsa"]
    tokens, width = plan.positions.shape[0], plan.max_seq_len
    assert width == max(batch.seq_lens_cpu.tolist())
    rows = plan.indexer_chunk_rows
    assert rows == max(1, budget // (-(-width // ROW_ALIGN) * ROW_ALIGN * 4))
    assert rows == 1 or rows * indexer_row_bytes(width) <= budget
    calls: list[tuple[int, int]] = []
    real = extend_attention.fp8_mqa_logits

    def spy(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        calls.append((q.shape[0], max_seqlen_k))
        return real(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)

    monkeypatch.setattr(extend_attention, "fp8_mqa_logits", spy)
    q, w, cache = indexer_inputs(seed, tokens, ties=False)
    indexer_topk_extend(plan, q, w, cache)
    if width <= topk:
        assert calls == []
        return
    sizes = [end - first for first, end in indexer_chunk_bounds(tokens, rows)]
    assert calls == [(n, width) for n in sizes]
    assert len(sizes) == -(-tokens // rows) and sum(sizes) == tokens
    assert all(n == rows for n in sizes[:-1]) and 1 <= sizes[-1] <= rows


@pytest.mark.parametrize("seed", range(8))
def test_only_tokens_past_topk_are_scored(seed, monkeypatch):
    """Under a static width (a captured plan's) every token goes through the logits kernel,
    but a token whose causal KV fits in top-k gets an empty range: the kernel and the
    selection do no work for it. Tokens past top-k keep their whole causal range."""
    rng = random.Random(seed)
    topk = rng.choice([4, 16, 64])
    batch = extend_batch(rng, rng.choice([ForwardMode.EXTEND, ForwardMode.MIXED]), 40)
    plan = widened(planner(topk, 1 << 30).plan(batch)["nsa"], MAX_CTX + 17, 1 << 30)
    ranges: list[torch.Tensor] = []
    real = extend_attention.fp8_mqa_logits

    def spy(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        ranges.append(ke - ks)
        return real(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)

    monkeypatch.setattr(extend_attention, "fp8_mqa_logits", spy)
    q, w, cache = indexer_inputs(seed, plan.positions.shape[0], ties=False)
    indexer_topk_extend(plan, q, w, cache)
    scored = torch.cat(ranges)
    kv = plan.kv_lens
    assert torch.equal(scored[kv <= topk], torch.zeros_like(scored[kv <= topk]))
    full = plan.kv_ranges[1] - plan.kv_ranges[0]
    assert torch.equal(scored[kv > topk], full[kv > topk])


def test_chunk_rows_and_bounds():
    assert indexer_row_bytes(1) == indexer_row_bytes(256) == 1024
    assert indexer_row_bytes(257) == 2048 and indexer_row_bytes(0) == 0
    assert indexer_chunk_rows(256, 1024) == 1 and indexer_chunk_rows(256, 4095) == 3
    assert indexer_chunk_rows(100_000, 1) == 1  # a row wider than the budget: alone
    assert indexer_chunk_rows(0, 1) == 1
    assert indexer_chunk_rows(16384, 512 << 20) == 8192
    assert indexer_chunk_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert indexer_chunk_bounds(6, 3) == [(0, 3), (3, 6)] and indexer_chunk_bounds(0, 3) == []


def test_a_captured_plan_chunks_by_the_static_bound():
    """The capture's plan is built at the limits' largest shape: its width is
    ``max_context`` and its chunk rows follow from it, whatever batch is replayed."""
    p = planner(16, 1 << 14)
    plan = p.plan(extend_batch(random.Random(4), ForwardMode.EXTEND, 40))["nsa"]
    assert plan.indexer_chunk_rows == indexer_chunk_rows(plan.max_seq_len, 1 << 14)
    dims = p.storages.max_dims(ForwardMode.EXTEND)
    assert dims["max_len"] == MAX_CTX
    assert dims["indexer_chunk_rows"] == indexer_chunk_rows(MAX_CTX, 1 << 14)


def test_no_host_op_is_left_in_the_extend_plan():
    assert "indexer_chunks" not in all_ops()
    fields = NSAExtendPlan.model_fields
    assert "indexer_plan" not in fields and "indexer_chunks" not in fields


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_the_extend_indexer_runs_under_the_capture_guard(mode):
    """No host read, no data-dependent shape, no host-built tensor: what a CUDA graph
    capture of the indexer needs (the plan is made before, as the planner does)."""
    batch = extend_batch(random.Random(9), mode, 40)
    plan = planner(16, 1 << 13).plan(batch)["nsa"]
    tokens = plan.positions.shape[0]
    q, w, cache = indexer_inputs(9, tokens, ties=False)
    want = indexer_topk_extend(plan, q, w, cache)
    assert plan.max_seq_len > 16  # tokens are scored: the chunk loop runs
    with CaptureGuard():
        got = indexer_topk_extend(plan, q, w, cache)
    assert torch.equal(got, want)
