"""The three phases agree: a replayed plan is bit-equal to the eager plan of the same batch."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import ForwardMode
from tests.support.batches import modes_for
from tests.support.planners import PlannerSetup, capture_all, pointers, replay_smallest

PAGE = 16
MAX_CTX = 200
MAX_BATCH = 12
SETUP = PlannerSetup(("paged",), MAX_BATCH, MAX_CTX, PAGE, pool=40, seed=1)
TABLE = SETUP.table


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), next_n=st.integers(1, 3), steps=st.integers(1, 8))
def test_replay_equals_eager_for_random_sequences(seed, next_n, steps):
    rng = random.Random(seed)
    planner = SETUP.planner(next_n=next_n)
    sizes = [1, 2, 4, 8, MAX_BATCH]
    modes = modes_for(next_n)
    captured = capture_all(planner, sizes, modes, TABLE)
    for _ in range(steps):
        mode = rng.choice(modes)
        batch = SETUP.batch(rng, next_n=next_n, mode=mode)
        bs, replayed = replay_smallest(planner, batch, sizes)  # record(): what the graph does
        plans, captured_pointers = captured[(mode, bs)]
        assert replayed is plans
        assert pointers(replayed) == captured_pointers
        padded = planner.plan(batch, pad_to=bs)
        for name, tensor in padded["paged"].tensors().items():
            assert torch.equal(tensor, getattr(replayed["paged"], name)), name
        # the unpadded eager plan is the top-left corner of the replayed one
        eager = planner.plan(batch)["paged"]
        n = batch.next_n
        assert torch.equal(eager.seq_lens, replayed["paged"].seq_lens[: batch.bs])
        assert torch.equal(eager.kv_lens, replayed["paged"].kv_lens[: batch.bs * n])
        assert torch.equal(eager.cu_seqlens_k, replayed["paged"].cu_seqlens_k[: batch.bs + 1])
        width = eager.token_slots.shape[1]
        assert torch.equal(eager.token_slots, replayed["paged"].token_slots[: batch.bs, :width])
        assert not replayed["paged"].token_slots[: batch.bs, width:].any()
        # padding rows hold the declared pad values
        tail = replayed["paged"]
        assert (tail.seq_lens[batch.bs :] == (n if mode is ForwardMode.TARGET_VERIFY else 1)).all()
        assert (tail.req_pool_indices[batch.bs :] == 0).all()
        assert (tail.page_table[batch.bs :] == 0).all()
        assert (tail.out_cache_loc[batch.bs * n :] == 0).all()
        planner.verify(batch, replayed)


def test_eager_plan_values_match_a_direct_computation():
    rng = random.Random(7)
    planner = SETUP.planner(next_n=1)
    batch = SETUP.batch(rng, bs=5)
    plan = planner.plan(batch)["paged"]
    lens = batch.seq_lens_cpu.tolist()
    assert plan.cu_seqlens_k.tolist() == [0] + list(torch.tensor(lens).cumsum(0).tolist())
    assert plan.max_seq_len == max(lens)
    for r, (req, length) in enumerate(zip(batch.req_pool_indices.tolist(), lens)):
        assert plan.token_slots[r, :length].tolist() == TABLE[req, :length].tolist()
        pages = -(-length // PAGE)
        assert plan.page_table[r, :pages].tolist() == (TABLE[req, :length:PAGE] // PAGE).tolist()
        assert not plan.page_table[r, pages:].any()


def test_verify_mode_causal_lengths():
    planner = SETUP.planner(next_n=3)
    batch = SETUP.batch(random.Random(3), next_n=3, mode=ForwardMode.TARGET_VERIFY, bs=2)
    plan = planner.plan(batch)["paged"]
    s0, s1 = batch.seq_lens_cpu.tolist()
    assert plan.kv_lens.tolist() == [s0 - 2, s0 - 1, s0, s1 - 2, s1 - 1, s1]
    assert plan.next_n == 3


def test_ops_outside_graph_refresh_on_replay():
    """With ops_in_graph=False (the seed's way), replay itself computes every op."""
    planner = SETUP.planner(max_batch=4, ops_in_graph=False)
    planner.capture(4, req_to_token=TABLE)
    batch = SETUP.batch(random.Random(5), bs=3)
    replayed = planner.replay(batch, 4)  # no record() needed
    planner.verify(batch, replayed)


def test_static_buffers_are_sized_from_limits():
    planner = SETUP.planner(next_n=1)
    planner.capture(2, req_to_token=TABLE)
    pages = -(-MAX_CTX // PAGE)
    expected = MAX_BATCH * MAX_CTX + MAX_BATCH * pages + MAX_BATCH + (MAX_BATCH + 1)
    assert planner.static_bytes() >= expected * 4
