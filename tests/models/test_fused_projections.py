"""Projections fused into one GEMM (``FusedWeights``): same results, same parameters, and
never a stale fused weight. The model fuses on CUDA only; here the layers are fused by
hand on the CPU and compared with their unfused selves (fp32, so within GEMM rounding)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.exact import FusedWeights
from dsv32_engine.models.layers.ffn import MLP
from dsv32_engine.models.model import DSV32Model


def test_fused_mlp_matches_and_keeps_its_parameters():
    torch.manual_seed(0)
    mlp = MLP(32, 48, torch.float32)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)
    plain = copy.deepcopy(mlp)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp.fuse_projections()
    x = torch.randn(5, 32)
    torch.testing.assert_close(mlp(x), plain(x), rtol=1e-5, atol=1e-6)
    after = mlp.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # load() copies in place: the fused buffer sees it
    mlp.w3.weight.data.copy_(torch.zeros_like(mlp.w3.weight))
    assert mlp.gate_up(x)[1].abs().max() == 0


def test_a_re_pointed_weight_falls_back_to_the_separate_layers():
    torch.manual_seed(1)
    mlp = MLP(16, 24, torch.float32)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)
    mlp.fuse_projections()
    mlp.w1.weight = nn.Parameter(torch.randn(24, 16), requires_grad=False)  # not a view any more
    x = torch.randn(3, 16)
    assert mlp.gate_up(x) is None
    want = mlp.w2(torch.nn.functional.silu(x @ mlp.w1.weight.t()) * (x @ mlp.w3.weight.t()))
    torch.testing.assert_close(mlp(x), want)


def test_bias_layers_are_refused():
    import pytest

    with pytest.raises(ValueError, match="bias-free"):
        FusedWeights([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])


def test_fused_model_matches_the_unfused_one_and_saves_the_same_tensors(tmp_path):
    cfg = DSV32Config.preset("tiny")
    plain = DSV32Model(cfg, seed=3, device="cpu", dtype=torch.float32)
    fused = DSV32Model(cfg, seed=3, device="cpu", dtype=torch.float32)
    for block in fused.layers:
        block.fuse_projections()
    assert all(b.attn.in_proj is not None for b in fused.layers)
    x = torch.randn(4, cfg.hidden_size)
    for a, b in zip(plain.layers, fused.layers, strict=True):
        got = b.attn.in_proj(x)
        want = (b.attn.wq_a(x), b.attn.wkv_a(x), b.attn.indexer.wk(x))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert a.attn.in_proj is None
    path = tmp_path / "w.safetensors"
    fused.save(path)
    loaded = DSV32Model.from_file(path)
    for (k, v), (k2, v2) in zip(
        plain.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
