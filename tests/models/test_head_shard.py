"""Head sharding for tensor parallel, in one process: two shards make exactly the whole.

Each rank keeps ``H / world`` heads of every layer's ``wq_b`` and ``wkv_b`` (rows) and
``wo`` (columns). A shard's queries and absorbed queries are the whole model's for its
heads, and the whole model's attention output is the sum of the shards' ``wo`` partials
(float64 on the CPU, rounded once): bit for bit. Refused when the ranks do not divide
the heads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from planner.errors import ConfigError


def _model() -> DSV32Model:
    return DSV32Model(DSV32Config.tiny(), device="cpu", dtype=torch.float32, seed=3)


def test_two_shards_make_the_whole_attention():
    whole = _model()
    heads = whole.config.num_attention_heads
    partials: list[torch.Tensor] = []

    def keep(partial: torch.Tensor) -> torch.Tensor:
        partials.append(partial)
        return partial

    shards = [copy.deepcopy(whole) for _ in range(2)]
    for rank, shard in enumerate(shards):
        shard.shard_attention_heads(rank, 2, keep)
        assert shard.attention_heads == heads // 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, whole.config.hidden_size, generator=g)
    cos = torch.ones(5, whole.config.qk_rope_head_dim // 2)
    sin = torch.zeros_like(cos)
    for layer in range(len(whole.layers)):
        full = whole.layers[layer].attn
        _, q_nope, q_rope = full.project_q(x, cos, sin)
        o_latent = torch.randn(5, heads, full.kv_lora, generator=g)
        want = full.output(o_latent)
        partials.clear()
        for rank, shard in enumerate(shards):
            attn = shard.layers[layer].attn
            own = slice(rank * heads // 2, (rank + 1) * heads // 2)
            _, s_nope, s_rope = attn.project_q(x, cos, sin)
            assert torch.equal(s_nope, q_nope[:, own]) and torch.equal(s_rope, q_rope[:, own])
            assert torch.equal(attn.absorb_q(s_nope), full.absorb_q(q_nope)[:, own])
            attn.output(o_latent[:, own])
        assert torch.equal((partials[0] + partials[1]).to(want.dtype), want)


def test_ranks_must_divide_the_heads():
    with pytest.raises(ConfigError, match="divide the attention heads") as info:
        _model().shard_attention_heads(0, 3, lambda p: p)
    assert info.value.field == "distributed.tp"
    sharded = _model()
    sharded.shard_attention_heads(1, 2, lambda p: p)
    with pytest.raises(ConfigError, match="one rank's heads"):
        sharded.save("never-written.safetensors")
