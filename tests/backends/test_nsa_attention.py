"""CPU tests of the layer-side NSA functions on a fake plan (a namespace with the planner's
attributes): indexer top-k against brute force, sparse == dense when top-k covers every
token, and no host syncs in the graph-path functions. (That a model is handed NSA plans
is checked once, when its engine is built: ``Planner.check_serves``.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import backends.nsa.attention as nsa
from backends.deepgemm import (
    PAGE,
    new_index_cache,
    quantize_fp8_e4m3_per_vector,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
    write_index_cache,
)
from planner.errors import PlanError

SCALE = 192**-0.5


def make_plan(seq_lens, next_n, topk, *, width=None, seed=0, num_sms=8, kernel_next_n=None):
    """A plan as the planner defines it, with each request's pages scattered at random.

    ``kernel_next_n`` (default: ``next_n`` where deep_gemm takes it, else 1) lays the rows
    out natively or expanded, one kernel request per row."""
    kernel_n = kernel_next_n or (next_n if next_n <= 2 else 1)
    g = torch.Generator().manual_seed(seed)
    reqs = len(seq_lens)
    width = width or -(-max(seq_lens) // PAGE) * PAGE
    cap_pages = -(-width // PAGE)
    num_pages = reqs * cap_pages + 1  # page 0 is the null page
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    token_slots = torch.zeros(reqs, cap_pages * PAGE, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        pages = perm[r * cap_pages : (r + 1) * cap_pages]
        t = torch.arange(n)
        token_slots[r, :n] = (pages[t // PAGE] * PAGE + t % PAGE).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    kv_lens = torch.stack([seq - (next_n - 1 - i) for i in range(next_n)], 1).reshape(-1)
    kv_lens = kv_lens.clamp(min=0).to(torch.int32)
    page_table = (token_slots[:, ::PAGE] // PAGE).contiguous()
    return SimpleNamespace(
        next_n=next_n,
        kernel_next_n=kernel_n,
        topk=topk,
        max_seq_len=width,
        seq_lens=seq,
        kv_lens=kv_lens,
        token_slots=token_slots,
        page_table=page_table,
        kernel_page_table=page_table.repeat_interleave(next_n // kernel_n, 0),
        topk_lens=kv_lens.clamp(max=topk),
        schedule=reference_paged_mqa_schedule(
            kv_lens.view(-1, kernel_n), 64, num_sms, check_values=False
        ),
        num_pages=num_pages,
    )


def make_index_inputs(plan, heads=32, seed=0):
    """Positive q, keys and weights: relu never clips, so scores are distinct."""
    g = torch.Generator().manual_seed(seed)
    rows = plan.kv_lens.shape[0]
    n_slots = plan.num_pages * PAGE
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(torch.rand(n_slots, 128, generator=g) + 0.01)
    cache = new_index_cache(plan.num_pages)
    write_index_cache(cache, torch.arange(n_slots), k_fp8, k_scale)
    q_fp8, _ = quantize_fp8_e4m3_per_vector(torch.rand(rows, heads, 128, generator=g))
    weights = torch.rand(rows, heads, generator=g) + 0.1
    return q_fp8, weights, cache


def brute_force_topk(plan, q_fp8, weights, cache):
    """Every query row scored as a decode request of its own (the reference logits, one row
    per request, its request's page table), then sorted: what any row layout must select."""
    rows, heads, dim = q_fp8.shape
    n = plan.next_n
    per_row = plan.kv_lens.view(-1, 1)
    logits = reference_fp8_paged_mqa_logits(
        q_fp8.view(-1, 1, heads, dim),
        cache,
        weights,
        per_row,
        plan.page_table.repeat_interleave(n, 0),
        reference_paged_mqa_schedule(per_row, 64, 8, check_values=False),
        plan.max_seq_len,
    )
    out = torch.full((rows, plan.topk), -1, dtype=torch.int32)
    for r in range(rows):
        length = min(int(plan.kv_lens[r]), plan.max_seq_len)
        scores = logits[r, :length]
        assert scores.unique().numel() == length, "test data must give distinct scores"
        order = torch.argsort(scores, descending=True)[: plan.topk].sort().values  # by position
        out[r, : order.numel()] = plan.token_slots[r // n, order]
    return out


def garbage_past_lengths(*args):
    """Like the real kernel: entries at/past a row's length are arbitrary (here huge or NaN)."""
    out = reference_fp8_paged_mqa_logits(*args)
    junk = torch.where(torch.arange(out.shape[1]) % 3 == 0, float("nan"), 1e30)
    return torch.where(torch.isinf(out), junk.expand_as(out), out)


@pytest.mark.parametrize("provider", ["reference", "garbage"])
@pytest.mark.parametrize(
    ("seq_lens", "next_n", "topk", "width"),
    [
        ([1, 70, 300], 1, 16, None),
        ([5, 129, 64, 400], 2, 32, None),  # MTP: row 0 of each pair sees one token less
        ([2, 3, 200], 2, 256, None),  # topk longer than most rows: -1 padding
        ([30, 60], 1, 100, 64),  # logits width narrower than topk
        ([1000, 3], 1, 2048, 1024),  # DSV32's topk on a short batch
    ],
)
def test_indexer_topk_matches_brute_force(monkeypatch, provider, seq_lens, next_n, topk, width):
    if provider == "garbage":
        monkeypatch.setattr(nsa, "fp8_paged_mqa_logits", garbage_past_lengths)
    plan = make_plan(seq_lens, next_n, topk, width=width, seed=len(seq_lens))
    # seed chosen so that every case's scores are distinct (the brute force requires it)
    q_fp8, weights, cache = make_index_inputs(plan, seed=topk + 1)
    got = nsa.indexer_topk(plan, q_fp8, weights, cache)
    assert got.dtype == torch.int32 and got.shape == (len(seq_lens) * next_n, topk)
    assert torch.equal(got, brute_force_topk(plan, q_fp8, weights, cache))
    assert torch.equal((got >= 0).sum(1).to(torch.int32), plan.topk_lens)
    q4 = q_fp8.view(len(seq_lens), next_n, *q_fp8.shape[1:])
    assert torch.equal(nsa.indexer_topk(plan, q4, weights, cache), got)


@pytest.mark.parametrize(("seq_lens", "next_n"), [([5, 129, 64], 2), ([9, 300], 4), ([70, 8], 8)])
def test_expanded_rows_select_what_native_rows_and_the_brute_force_select(seq_lens, next_n):
    """One row per draft token (staircase lengths, the block table repeated, the schedule over
    the rows with next_n 1) is the same indexer as native rows where deep_gemm has them."""
    expanded = make_plan(seq_lens, next_n, 32, seed=7, kernel_next_n=1)
    q_fp8, weights, cache = make_index_inputs(expanded, seed=33)
    got = nsa.indexer_topk(expanded, q_fp8, weights, cache)
    assert torch.equal(got, brute_force_topk(expanded, q_fp8, weights, cache))
    if next_n <= 2:
        native = make_plan(seq_lens, next_n, 32, seed=7)
        assert torch.equal(nsa.indexer_topk(native, q_fp8, weights, cache), got)


def test_indexer_topk_never_returns_future_or_null_slots():
    plan = make_plan([3, 3], 2, 8, seed=5)
    q_fp8, weights, cache = make_index_inputs(plan)
    got = nsa.indexer_topk(plan, q_fp8, weights, cache)
    for r in range(4):
        want = set(plan.token_slots[r // 2, : int(plan.kv_lens[r])].tolist())
        picked = {s for s in got[r].tolist() if s >= 0}
        assert picked == want and 0 not in picked


def make_mla_inputs(plan, heads=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = plan.kv_lens.shape[0]
    q_abs = torch.randn(rows, heads, 512, generator=g).to(dtype)
    q_rope = torch.randn(rows, heads, 64, generator=g).to(dtype)
    kv = (torch.randn(plan.num_pages * PAGE, 576, generator=g) * 0.5).to(dtype)
    return q_abs, q_rope, kv


@pytest.mark.parametrize(("seq_lens", "next_n"), [([1, 50, 130], 1), ([2, 3, 77], 2)])
def test_sparse_equals_dense_when_topk_covers_all(seq_lens, next_n):
    plan = make_plan(seq_lens, next_n, topk=256, seed=3)
    q_fp8, weights, cache = make_index_inputs(plan)
    slots = nsa.indexer_topk(plan, q_fp8, weights, cache)
    q_abs, q_rope, kv = make_mla_inputs(plan)
    sparse = nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, SCALE)
    dense = nsa.dense_mla_decode(plan, q_abs, q_rope, kv, SCALE)
    assert sparse.shape == q_abs.shape and sparse.dtype == q_abs.dtype
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    shuffled = slots[:, torch.randperm(slots.shape[1], generator=torch.Generator().manual_seed(1))]
    torch.testing.assert_close(nsa.sparse_mla_decode(q_abs, q_rope, kv, shuffled, SCALE), sparse)


def test_sparse_row_without_valid_slots_is_zero():
    plan = make_plan([8], 1, topk=8)
    q_abs, q_rope, kv = make_mla_inputs(plan)
    slots = torch.full((1, 8), -1, dtype=torch.int32)
    assert bool((nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, SCALE) == 0).all())


def test_indexer_rejects_zero_length_rows_on_cpu():
    plan = make_plan([1, 9], 2, topk=4)  # seq_len 1 < next_n: row 0 would see nothing
    q_fp8, weights, cache = make_index_inputs(plan)
    with pytest.raises(PlanError) as e:
        nsa.indexer_topk(plan, q_fp8, weights, cache)
    assert e.value.field == "context_lens"


def test_sparse_over_a_subset_is_attention_over_that_subset():
    plan = make_plan([300, 90], 1, topk=64, seed=8)
    q_fp8, weights, cache = make_index_inputs(plan)
    slots = nsa.indexer_topk(plan, q_fp8, weights, cache)
    q_abs, q_rope, kv = make_mla_inputs(plan, seed=2)
    sparse = nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, SCALE)
    # The subset as its own "dense" plan: valid slots first (topk returns them first).
    sub = SimpleNamespace(next_n=1, kv_lens=(slots >= 0).sum(1).to(torch.int32), token_slots=slots)
    torch.testing.assert_close(sparse, nsa.dense_mla_decode(sub, q_abs, q_rope, kv, SCALE))


def test_sparse_bf16_keeps_dtype_and_accuracy():
    plan = make_plan([40], 1, topk=64)
    q_abs, q_rope, kv = make_mla_inputs(plan, dtype=torch.bfloat16)
    slots = torch.full((1, 64), -1, dtype=torch.int32)
    slots[0, :40] = plan.token_slots[0, :40]
    out = nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, SCALE)
    assert out.dtype == torch.bfloat16
    ref = nsa.dense_mla_decode(plan, q_abs, q_rope, kv, SCALE)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_mla_shape_errors():
    plan = make_plan([4], 1, topk=4)
    q_abs, q_rope, kv = make_mla_inputs(plan)
    slots = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(PlanError) as e:
        nsa.sparse_mla_decode(q_abs, q_rope[:, :2], kv, slots, SCALE)
    assert e.value.field == "q_rope"
    with pytest.raises(PlanError) as e:
        nsa.sparse_mla_decode(q_abs, q_rope, kv[:, :512], slots, SCALE)
    assert e.value.field == "kv_cache"
    with pytest.raises(PlanError) as e:
        nsa.sparse_mla_decode(q_abs, q_rope, kv, slots.view(-1), SCALE)
    assert e.value.field == "topk_slots"


def test_graph_path_has_no_host_syncs(monkeypatch):
    """indexer_topk and sparse_mla_decode must not read tensor values on the host."""
    plan = make_plan([33, 7, 150], 2, topk=32, seed=4)
    q_fp8, weights, cache = make_index_inputs(plan)
    q_abs, q_rope, kv = make_mla_inputs(plan)

    def logits_no_value_checks(*args):
        return reference_fp8_paged_mqa_logits(*args, check_values=False)

    monkeypatch.setattr(nsa, "fp8_paged_mqa_logits", logits_no_value_checks)

    def boom(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    slots = nsa.indexer_topk(plan, q_fp8, weights, cache)
    out = nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, SCALE)
    monkeypatch.undo()
    assert out.shape == q_abs.shape and math.isfinite(float(out.abs().sum()))
