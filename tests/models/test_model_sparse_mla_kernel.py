"""The model's sparse MLA on the Triton kernel (split table from the plan) equals the reference.

Under ``TRITON_INTERPRET=1`` on the CPU the kernel runs the tiny model's shapes; on a
GPU the same code runs compiled (tests/gpu/test_sparse_mla_gpu.py times and checks it at
the real shapes).
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from planner import ForwardBatch, ForwardMode, Limits, Planner
from tests.support.batches import make_pool

pytestmark = pytest.mark.triton
CFG = DSV32Config.tiny()
CTX = 128


def _plans(kernel: str, batch: ForwardBatch):
    limits = Limits(max_batch=4, max_context=CTX, num_sms=8, max_tokens=64)
    options = {
        "nsa": {"topk": CFG.index_topk, "mla_heads": CFG.num_attention_heads, "mla_kernel": kernel}
    }
    return Planner(["nsa"], limits, options=options).plan(batch)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_triton_sparse_mla_equals_the_reference_through_the_model(mode):
    rng = random.Random(mode.value)
    table = make_pool(6, CTX, 64, seed=3)
    model = DSV32Model(CFG, seed=0, dtype=torch.float32)
    lens = [rng.randint(20, CTX) for _ in range(3)]
    new = [1] * 3 if mode is ForwardMode.DECODE else [rng.randint(1, 12) for _ in range(3)]
    pools = [1, 2, 3]
    locs = [int(table[p, q]) for p, n, e in zip(pools, lens, new) for q in range(n - e, n)]
    batch = ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(pools, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        mode=mode,
        extend_lens_cpu=None
        if mode is ForwardMode.DECODE
        else torch.tensor(new, dtype=torch.int32),
    )
    ids = torch.tensor([rng.randrange(CFG.vocab_size) for _ in locs])
    outs = {}
    for kernel in ("torch", "triton"):
        cache = model.new_cache(int(table.max()) // 64 + 1)
        outs[kernel] = model(ids, _plans(kernel, batch), cache)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)
