"""The MTP draft layer: every batch kind it runs in equals feeding its tokens one at a time.

Reference: each (token, hidden) pair through a one-token decode plan of its own, in order.
Under test: a draft extend of random accept lengths (``next_n`` rows per request, padding
rows masked), a draft decode of ``k`` steps in one forward (step ``s`` reading its own
plan), a draft prefill over an extend plan, and the same through emulated graphs at
padded sizes. Outputs (draft tokens, hidden states) and the layer's KV and index cache at
every real slot must be bit-equal; padding rows may only write the null slot.

32 index heads, as in every exact-equivalence test through the indexer (DSV32.md).
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.deepgemm import BLOCK_KV
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import MTPDraft
from graphs import GraphRunner
from graphs.inputs import InputSpec
from planner import ForwardBatch, ForwardMode, Limits, Planner

CFG = DSV32Config.model_validate({**DSV32Config.tiny().model_dump(), "index_n_heads": 32})
CTX, REQS, NEXT_N, STEPS = 192, 4, 4, 3
PAGES = -(-CTX // BLOCK_KV)
DIM = CFG.hidden_size


@pytest.fixture(scope="module")
def mtp() -> MTPDraft:
    return MTPDraft(DSV32Model(CFG, dtype=torch.float32), seed=1)


def _planner() -> Planner:
    limits = Limits(
        max_batch=REQS,
        max_context=CTX,
        next_n=NEXT_N,
        draft_steps=STEPS,
        num_sms=8,
        max_tokens=REQS * CTX,
    )
    return Planner(["nsa"], limits, options={"nsa": {"topk": CFG.index_topk}})


class World:
    """Requests over one MTP cache: request ``r`` owns pages, slot ``page * 64 + offset``."""

    def __init__(self, mtp: MTPDraft, seed: int) -> None:
        self.cache: PagedKVCache = mtp.new_cache(REQS * PAGES + 1)
        self.pool = RequestPool(REQS + 1, CTX, page_size=BLOCK_KV)
        self.rows = []
        for _ in range(REQS):
            row = self.pool.alloc()
            self.pool.assign(row, self.cache.alloc(PAGES), CTX)
            self.rows.append(row)
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, CFG.vocab_size, (REQS, CTX), generator=g)
        self.hidden = torch.randn(REQS, CTX, DIM, generator=g)

    def batch(self, work: list[tuple[int, int, int]], mode: ForwardMode, n: int = 1):
        """``work``: (request, first position, tokens); a batch of ``mode`` over them."""
        table = self.pool.req_to_token
        locs = [table[self.rows[r], p] for r, f, k in work for p in range(f, f + k)]
        lens = [f + k for _, f, k in work]
        extend = mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND)
        return ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor([self.rows[r] for r, _, _ in work], dtype=torch.int32),
            req_to_token=table,
            out_cache_loc=torch.stack(locs).to(torch.int32),
            mode=mode,
            next_n=n,
            extend_lens_cpu=torch.tensor([k for _, _, k in work], dtype=torch.int32)
            if extend
            else None,
        )

    def inputs(self, work: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([self.ids[r, f : f + k] for r, f, k in work])
        hidden = torch.cat([self.hidden[r, f : f + k] for r, f, k in work])
        return ids, hidden

    def kv(self, r: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.pool.req_to_token[self.rows[r], :upto].long()
        index = self.cache.index[0].view(-1, self.cache.index[0].shape[-1])
        return self.cache.mla[0][slots], index[slots]


def _one_by_one(mtp, world, planner, work):
    """The reference: each pair of ``work`` through its own decode plan, request by request;
    each request's last output (token and hidden)."""
    last = {}
    for r, first, k in work:
        for p in range(first, first + k):
            one = [(r, p, 1)]
            ids, hidden = world.inputs(one)
            plans = planner.plan(world.batch(one, ForwardMode.DECODE))
            out = mtp(ids, hidden, plans, world.cache)
            last[r] = (int(out["tokens"][0]), out["hidden"][0])
    return last


def _prefix(mtp, world, planner, lens):
    """Each request's first ``lens`` pairs in one draft prefill (itself tested against the
    one-by-one reference below)."""
    work = [(r, 0, n) for r, n in enumerate(lens)]
    ids, hidden = world.inputs(work)
    mtp(ids, hidden, planner.plan(world.batch(work, ForwardMode.EXTEND)), world.cache)


@pytest.mark.parametrize("seed", range(4))
def test_draft_extend_equals_its_accepted_tokens_one_by_one(mtp, seed):
    rng = random.Random(seed)
    planner = _planner()
    bs = rng.randint(1, REQS)
    starts = [rng.randint(1, CTX - NEXT_N) for _ in range(bs)]
    accepted = [rng.randint(1, NEXT_N) for _ in range(bs)]
    work = [(r, s, a) for r, (s, a) in enumerate(zip(starts, accepted))]
    want_world, got_world = World(mtp, seed), World(mtp, seed)
    for world in (want_world, got_world):
        _prefix(mtp, world, planner, starts)
    want = _one_by_one(mtp, want_world, planner, work)
    ids, hidden = got_world.inputs(work)
    plans = planner.plan(got_world.batch(work, ForwardMode.DRAFT_EXTEND, NEXT_N))
    out = mtp(ids, hidden, plans, got_world.cache)
    for r in range(bs):
        assert int(out["tokens"][r]) == want[r][0]
        assert torch.equal(out["hidden"][r], want[r][1])
        for a, b in zip(
            got_world.kv(r, starts[r] + accepted[r]), want_world.kv(r, starts[r] + accepted[r])
        ):
            assert torch.equal(a, b)  # padding rows wrote the null slot only


@pytest.mark.parametrize("seed", range(3))
def test_draft_decode_steps_equal_one_decode_per_step(mtp, seed):
    """k steps in one forward, each reading its own plan, lengths +1 per step."""
    rng = random.Random(10 + seed)
    planner = _planner()
    bs = rng.randint(1, REQS)
    starts = [rng.randint(1, CTX - STEPS) for _ in range(bs)]
    want_world, got_world = World(mtp, seed), World(mtp, seed)
    for world in (want_world, got_world):
        _prefix(mtp, world, planner, starts)
    ids, hidden = got_world.inputs([(r, s, 1) for r, s in enumerate(starts)])
    work = [(r, s, STEPS) for r, s in enumerate(starts)]
    plans = planner.plan(got_world.batch(work, ForwardMode.DRAFT_DECODE, STEPS))
    out = mtp(ids, hidden, plans, got_world.cache)
    assert out["tokens"].shape == (bs, STEPS)
    # reference: step s feeds the previous step's argmax and hidden state at position start + s
    cur_ids, cur_h = ids, hidden
    for s in range(STEPS):
        step = [(r, p + s, 1) for r, p in enumerate(starts)]
        ref = mtp(
            cur_ids,
            cur_h,
            planner.plan(want_world.batch(step, ForwardMode.DECODE)),
            want_world.cache,
        )
        assert torch.equal(out["tokens"][:, s], ref["tokens"])
        cur_ids, cur_h = ref["tokens"], ref["hidden"]
    assert torch.equal(out["hidden"], cur_h)
    for r, p in enumerate(starts):
        for a, b in zip(got_world.kv(r, p + STEPS), want_world.kv(r, p + STEPS)):
            assert torch.equal(a, b)


def test_draft_prefill_over_an_extend_plan_equals_one_by_one(mtp):
    planner = _planner()
    work = [(0, 0, 37), (1, 0, 5), (2, 0, 70)]
    want_world, got_world = World(mtp, 7), World(mtp, 7)
    want = _one_by_one(mtp, want_world, planner, work)
    ids, hidden = got_world.inputs(work)
    out = mtp(ids, hidden, planner.plan(got_world.batch(work, ForwardMode.EXTEND)), got_world.cache)
    for r, _, n in work:
        assert int(out["tokens"][r]) == want[r][0] and torch.equal(out["hidden"][r], want[r][1])
        for a, b in zip(got_world.kv(r, n), want_world.kv(r, n)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE])
def test_graph_replays_at_padded_sizes_equal_eager(mtp, mode):
    """Captured at sizes 2 and 4, replayed for 1..4 requests: outputs and caches as eager."""
    planner = _planner()
    rng = random.Random(3)
    graph_world, eager_world = World(mtp, 3), World(mtp, 3)
    per = "rows" if mode is ForwardMode.DRAFT_EXTEND else "reqs"
    runner = GraphRunner(
        planner,
        lambda inputs, plans: mtp(inputs["input_ids"], inputs["hidden"], plans, graph_world.cache),
        req_to_token=graph_world.pool.req_to_token,
        static_inputs={
            "input_ids": InputSpec(torch.int64, per=per),
            "hidden": InputSpec(torch.float32, (DIM,), per=per),
        },
        modes=[mode],
        sizes=[2, 4],
    )
    runner.capture()
    starts = [20, 90, 3, 150]
    for world in (graph_world, eager_world):
        _prefix(mtp, world, planner, starts)
    for bs in (3, 1, 4, 2):
        if mode is ForwardMode.DRAFT_EXTEND:
            work = [(r, starts[r], rng.randint(1, NEXT_N)) for r in range(bs)]
            ids, hidden = graph_world.inputs(work)
            n = NEXT_N
        else:
            work = [(r, starts[r], STEPS) for r in range(bs)]
            ids, hidden = graph_world.inputs([(r, starts[r], 1) for r in range(bs)])
            n = STEPS
        got = runner.step(graph_world.batch(work, mode, n), {"input_ids": ids, "hidden": hidden})
        want = mtp(ids, hidden, planner.plan(eager_world.batch(work, mode, n)), eager_world.cache)
        assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(
            got["hidden"], want["hidden"]
        )
    assert runner.stats.steps == 4 and not runner.stats.eager
    real = slice(BLOCK_KV, None)  # past the null page, which padding rows write
    assert torch.equal(graph_world.cache.mla[0][real], eager_world.cache.mla[0][real])
    assert torch.equal(graph_world.cache.index[0][1:], eager_world.cache.index[0][1:])
