"""The invariant: a prompt prefilled in chunks gives what feeding it one token at a time gives.

Reference: every prompt token fed through a decode plan, one step each. Under test: the
same prompts fed as extend batches of random chunk budgets, several requests per batch,
some of them decoding in the same batch (mixed). The next token must be the same and the
KV and index caches must hold the same values (KV within 1e-5, as specified; the CPU
reference model is batch-invariant, so in practice they are bit-equal).

The model has 32 index heads: with the tiny preset's 4, ``relu(q . k)`` is exactly 0 for
about one key in 16, scores tie and ``torch.topk`` may keep either key (DSV32.md).
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.deepgemm import BLOCK_KV, gather_index_cache
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from planner import ForwardBatch, ForwardMode, Limits, Planner

CTX = 192
PAGES_PER_REQUEST = -(-CTX // BLOCK_KV)
CFG = DSV32Config.model_validate({**DSV32Config.tiny().model_dump(), "index_n_heads": 32})


@pytest.fixture(scope="module")
def model() -> DSV32Model:
    return DSV32Model(CFG, seed=0, dtype=torch.float32)


def _planner(budget_bytes: int) -> Planner:
    limits = Limits(max_batch=4, max_context=CTX, num_sms=8, max_tokens=4 * CTX)
    options = {"nsa": {"topk": CFG.index_topk, "indexer_logits_bytes": budget_bytes}}
    return Planner(["nsa"], limits, options=options)


class Requests:
    """Requests over one fresh cache: each owns its pages, slot ``page * 64 + offset``."""

    def __init__(self, model: DSV32Model, prompts: list[list[int]]) -> None:
        self.cache: PagedKVCache = model.new_cache(len(prompts) * PAGES_PER_REQUEST + 1)
        self.pool = RequestPool(len(prompts) + 1, CTX, page_size=BLOCK_KV)
        self.rows = []
        for _ in prompts:
            row = self.pool.alloc()
            self.pool.assign(row, self.cache.alloc(PAGES_PER_REQUEST), CTX)
            self.rows.append(row)
        self.prompts = prompts

    def batch(self, work: list[tuple[int, int, int]], mode: ForwardMode) -> ForwardBatch:
        """``work``: (request, first position, tokens) for each request of the batch."""
        table = self.pool.req_to_token
        locs = [table[self.rows[r], p] for r, first, n in work for p in range(first, first + n)]
        lens = [first + n for _, first, n in work]
        return ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor([self.rows[r] for r, _, _ in work], dtype=torch.int32),
            req_to_token=table,
            out_cache_loc=torch.stack(locs).to(torch.int32),
            mode=mode,
            extend_lens_cpu=None
            if mode is ForwardMode.DECODE
            else torch.tensor([n for _, _, n in work], dtype=torch.int32),
        )

    def ids(self, work: list[tuple[int, int, int]]) -> torch.Tensor:
        return torch.tensor([t for r, f, n in work for t in self.prompts[r][f : f + n]])

    def kv(self, r: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Request ``r``'s cached latents, index keys and key scales of layer ``layer``."""
        slots = self.pool.req_to_token[self.rows[r], : len(self.prompts[r])]
        keys, scales = gather_index_cache(self.cache.index[layer], slots)
        return self.cache.mla[layer][slots.long()], keys.float(), scales


def token_by_token(model: DSV32Model, prompts: list[list[int]]) -> tuple[Requests, list[int]]:
    """The reference: every prompt token through its own decode plan."""
    planner, reqs = _planner(1 << 30), Requests(model, prompts)
    last = []
    for r, prompt in enumerate(prompts):
        for p in range(len(prompt)):
            work = [(r, p, 1)]
            logits = model(
                reqs.ids(work), planner.plan(reqs.batch(work, ForwardMode.DECODE)), reqs.cache
            )
        last.append(int(logits[-1].argmax()))
    return reqs, last


def chunked(
    model: DSV32Model, prompts: list[list[int]], rng: random.Random
) -> tuple[Requests, list[int], int]:
    """The prompts in extend batches of random budgets; finished requests decode alongside."""
    planner = _planner(rng.choice([4 << 10, 16 << 10, 1 << 30]))  # chunked logits too
    reqs = Requests(model, prompts)
    fed = [0] * len(prompts)
    last: dict[int, int] = {}
    mixed_batches = 0
    while len(last) < len(prompts):
        budget = rng.randint(1, 96)
        work = []
        for r, prompt in enumerate(prompts):
            if fed[r] < len(prompt) and budget:
                n = min(len(prompt) - fed[r], budget, rng.randint(1, 64))
                work.append((r, fed[r], n))
                budget -= n
        # A request whose prompt is done feeds its last prompt token again as a decode row
        # of a mixed batch: the same position, the same KV, so the result must not change.
        done = [r for r in range(len(prompts)) if fed[r] == len(prompts[r])]
        decoders = rng.sample(done, k=min(len(done), rng.randint(0, 2)))
        work += [(r, len(prompts[r]) - 1, 1) for r in decoders]
        mode = ForwardMode.MIXED if decoders else ForwardMode.EXTEND
        mixed_batches += bool(decoders)
        logits = model(reqs.ids(work), planner.plan(reqs.batch(work, mode)), reqs.cache)
        for (r, first, n), row in zip(work, logits):
            fed[r] = max(fed[r], first + n)
            if fed[r] == len(prompts[r]):
                last[r] = int(row.argmax())
    return reqs, [last[r] for r in range(len(prompts))], mixed_batches


@pytest.mark.parametrize("seed", range(6))
def test_chunked_prefill_equals_token_by_token_decode(model, seed):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 90))]
        for _ in range(rng.randint(1, 4))
    ]
    want, want_next = token_by_token(model, prompts)
    got, got_next, _ = chunked(model, prompts, rng)
    assert got_next == want_next
    for r in range(len(prompts)):
        for layer in range(CFG.num_hidden_layers):
            for name, a, b in zip(
                ("latent", "index keys", "key scales"), got.kv(r, layer), want.kv(r, layer)
            ):
                diff = float((a - b).abs().max()) if a.numel() else 0.0
                assert diff <= 1e-5, (seed, r, layer, name, diff)


def test_mixed_batches_are_exercised(model):
    """The seeds above do build mixed batches (a test that cannot fail proves nothing)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (3, 80, 70)]
    assert chunked(model, prompts, rng)[2] > 0


def _engine_tokens(chunk: int, mixed: bool) -> dict[int, list[int]]:
    overrides = {
        "loop.requests": 6,
        "loop.prompt_len": [1, 70],
        "loop.max_new_tokens": [2, 12],
        "loop.chunk_tokens": chunk,
        "loop.mixed": mixed,
        "planner.max_batch": 4,
        "planner.max_context": CTX,
        "model.overrides": {"index_n_heads": 32},
    }
    engine = DecodeEngine(load_run_config(None, overrides))
    return engine.run(progress=False, keep_tokens=True).tokens


def test_the_decode_loop_serves_the_same_tokens_whatever_the_chunk_budget():
    """End to end: chunk budgets and mixed or separate decode change nothing generated."""
    reference = _engine_tokens(1, False)
    assert len(reference) == 6
    for chunk, mixed in ((7, False), (7, True), (256, True), (256, False)):
        assert _engine_tokens(chunk, mixed) == reference, (chunk, mixed)
