"""The batch-invariant mode compiled on the GPU, in bf16: a row's bits never depend on its batch.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_invariant_gemm.py``)
check the kernel's indexing and the mode's reach; these check the compiled numerics:

- every GEMM site of the forward (the module call, with the mode on), for one row alone
  (M = 1), inside batches of 4 and 8 rows (a decode of k and its verify of k + 1 shapes)
  and of 64 rows, at a random position: bit-identical;
- the kernel against the float64 reference rounded once (bf16 and fp32);
- the whole model: one request decoded alone and inside a batch of 8 requests, token by
  token over a context longer than the indexer's top-k: its logits bit-identical at every
  step (the mode on; the sparse MLA planned with fixed splits, as the engine plans it).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.kv_cache import RequestPool  # noqa: E402
from dsv32_engine.models.layers.exact import Linear  # noqa: E402
from dsv32_engine.models.layers.ffn import MLP, Gate, MoE  # noqa: E402
from dsv32_engine.models.layers.invariant_gemm import (  # noqa: E402
    invariant_linear,
    linear_reference,
)
from dsv32_engine.models.model import DSV32Model  # noqa: E402
from dsv32_engine.models.mtp import MTPDraft  # noqa: E402
from planner import ForwardBatch, Limits, Planner  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SIZES = (4, 8, 64)
CFG = DSV32Config.model_validate({**DSV32Config.small().model_dump(), "index_topk": 64})
"""The small preset (real attention and indexer widths) with a top-k of 64, so a context of
a hundred tokens already makes the indexer choose."""


def _same_row_everywhere(fn, width: int, seed: int) -> None:
    """``fn(x [M, width]) -> tensor or tuple`` row ``r``'s bits alone and inside batches."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    row = torch.randn(1, width, generator=gen, device=DEV).to(BF16)
    alone = fn(row)
    alone = alone if isinstance(alone, tuple) else (alone,)
    rng = random.Random(seed)
    for m in SIZES:
        pos = rng.randrange(m)
        batch = torch.randn(m, width, generator=gen, device=DEV).to(BF16)
        batch[pos] = row[0]
        out = fn(batch)
        out = out if isinstance(out, tuple) else (out,)
        for a, b in zip(alone, out, strict=True):
            assert torch.equal(a[0], b[pos]), (m, pos)


@pytest.fixture(scope="module")
def model() -> DSV32Model:
    m = DSV32Model(CFG, device=DEV, dtype=BF16)
    m.set_batch_invariant(True)
    return m


def test_kernel_matches_the_float64_reference() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    for dtype, tol in ((BF16, 1e-2), (torch.float32, 1e-5)):
        for n, k in ((8192, 1024), (576, 1024), (40, 72), (129, 2048)):
            w = (torch.randn(n, k, generator=gen, device=DEV) / k**0.5).to(dtype)
            x = torch.randn(37, k, generator=gen, device=DEV).to(dtype)
            out = invariant_linear(x, w)
            ref = linear_reference(x, w)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # The indexer's head weights: bf16 activations, fp32 weight, fp32 out.
    w = torch.randn(64, 1024, generator=gen, device=DEV) / 32
    x = torch.randn(9, 1024, generator=gen, device=DEV).to(BF16)
    out = invariant_linear(x, w, out_dtype=torch.float32)
    ref = linear_reference(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "site",
    [
        "wq_a|wkv_a|wk",
        "wq_b",
        "indexer.wq_b",
        "indexer.weights_proj",
        "absorb",
        "output+wo",
        "dense_mlp",
        "gate",
        "shared_expert",
        "moe",
        "head",
        "eh_proj",
    ],
)
def test_every_gemm_site_is_row_invariant(model: DSV32Model, site: str) -> None:
    attn = model.layers[0].attn
    d = CFG.hidden_size
    moe = next(b.ffn for b in model.layers if isinstance(b.ffn, MoE))
    dense = model.layers[0].ffn
    assert isinstance(dense, MLP) and isinstance(moe.gate, Gate)
    assert attn.in_proj is not None and dense.gate_up is not None  # CUDA fuses
    width, fn = d, None
    if site == "wq_a|wkv_a|wk":
        fn = lambda x: attn.in_proj(x, True)  # noqa: E731
    elif site == "wq_b":
        width, fn = CFG.q_lora_rank, attn.wq_b
    elif site == "indexer.wq_b":
        width, fn = CFG.q_lora_rank, attn.indexer.wq_b
    elif site == "indexer.weights_proj":
        fn = attn.indexer._head_weights
    elif site == "absorb":
        width = attn.n_heads * attn.nope

        def fn(x):
            return attn.absorb_q(x.view(x.shape[0], attn.n_heads, attn.nope))
    elif site == "output+wo":
        width = attn.n_heads * attn.kv_lora

        def fn(x):
            return attn.output(x.view(x.shape[0], attn.n_heads, attn.kv_lora))
    elif site == "dense_mlp":
        fn = dense
    elif site == "gate":
        fn = moe.gate
    elif site == "shared_expert":
        fn = moe.shared
    elif site == "moe":
        fn = moe
    elif site == "head":
        fn = model.head
    elif site == "eh_proj":
        draft = MTPDraft(model, seed=1)
        draft.set_batch_invariant(True)
        width, fn = 2 * d, draft.eh_proj
    with torch.no_grad():
        _same_row_everywhere(fn, width, seed=zlib.crc32(site.encode()))


def test_default_mode_is_untouched(model: DSV32Model) -> None:
    """Off, the sites run their default kernels (cuBLAS): the mode is a switch, not a
    rewrite. Checked by bits against the plain torch call at one shape."""
    layer = Linear(CFG.hidden_size, 512, bias=False, dtype=BF16, device=DEV)
    layer.weight.data.normal_(std=CFG.hidden_size**-0.5)
    x = torch.randn(8, CFG.hidden_size, device=DEV).to(BF16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


# ------------------------------------------------------------------ whole model

CTX, STEPS, OTHERS, PREFIX = 256, 96, 7, 64


class _World:
    """A cache and request table of its own; the same pages and slots in every world."""

    def __init__(self, model: DSV32Model, reqs: int) -> None:
        pages = -(-CTX // CFG.page_size)
        self.cache = model.new_cache(reqs * pages + 1)
        self.pool = RequestPool(reqs + 1, CTX, page_size=CFG.page_size, device=DEV)
        self.rows = []
        for _ in range(reqs):
            row = self.pool.alloc()
            self.pool.assign(row, self.cache.alloc(pages), CTX)
            self.rows.append(row)

    def batch(self, lens: list[int], first: int = 0) -> ForwardBatch:
        """A decode step of requests ``first ..`` at KV lengths ``lens``."""
        table = self.pool.req_to_token
        rows = torch.tensor(self.rows[first : first + len(lens)], device=DEV)
        seq = torch.tensor(lens, dtype=torch.int32)
        pos = (seq - 1).to(DEV)
        return ForwardBatch(
            seq_lens_cpu=seq,
            req_pool_indices=rows.to(torch.int32),
            req_to_token=table,
            out_cache_loc=table[rows, pos.long()].to(torch.int32),
            positions=pos,
        )

    def batch_of(self, r: int, length: int) -> ForwardBatch:
        return self.batch([length], first=r)


def _planner(model: DSV32Model) -> Planner:
    limits = Limits(max_batch=OTHERS + 1, max_context=CTX, device="cuda")
    options = {
        "nsa": {
            "topk": CFG.index_topk,
            "mla_heads": model.attention_heads,
            "mla_fixed_splits": 4,  # the engine's plan in the mode (INVARIANT_MLA_SPLITS)
            "native_next_n": (),
        }
    }
    return Planner(["nsa"], limits, options=options)


@torch.no_grad()
def test_a_request_decodes_to_the_same_logits_alone_and_in_a_batch_of_8(
    model: DSV32Model,
) -> None:
    planner = _planner(model)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG.vocab_size, (OTHERS + 1, STEPS), generator=gen)
    alone, crowd = _World(model, 1), _World(model, OTHERS + 1)
    offsets = [0] + [random.Random(i).randrange(0, PREFIX) for i in range(OTHERS)]
    # The others start at other lengths (their own prefixes, fed one token at a time), so
    # the batch is ragged.
    for r in range(1, OTHERS + 1):
        for p in range(offsets[r]):
            tok = ids[r, p % STEPS].view(1).to(DEV)
            model(tok, planner.plan(crowd.batch_of(r, p + 1)), crowd.cache)
    mismatched = []
    for step in range(STEPS):
        one = model(ids[:1, step].to(DEV), planner.plan(alone.batch([step + 1])), alone.cache)
        lens = [step + 1] + [offsets[r] + step + 1 for r in range(1, OTHERS + 1)]
        toks = torch.tensor(
            [int(ids[0, step])]
            + [int(ids[r, (offsets[r] + step) % STEPS]) for r in range(1, OTHERS + 1)],
            device=DEV,
        )
        many = model(toks, planner.plan(crowd.batch(lens)), crowd.cache)
        if not torch.equal(one[0], many[0]):
            mismatched.append(step)
    assert not mismatched, f"logits differ at steps {mismatched}"
