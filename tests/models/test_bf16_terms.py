"""The indexer's fp32 head-weight projection as bf16 terms: the split is exact, and the
projection sums to the fp32 product. The GEMM itself (``torch.mm(..., out_dtype=float32)``)
exists on CUDA only: tests/gpu/test_bf16_terms_gpu.py runs it; here its arithmetic is
emulated in float64, which is exact for these products and sums of three."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv32_engine.models.layers.bf16_terms import (
    Bf16TermsProjection,
    bf16_terms,
    mm_fp32_out_available,
)


@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 1e4])
def test_three_bf16_terms_sum_to_every_fp32_weight_exactly(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 7) % 1000)
    w = torch.randn(64, 300, generator=gen) * scale
    terms = bf16_terms(w)
    assert terms.dtype == torch.bfloat16 and terms.shape == (192, 300)
    t = terms.double().view(3, 64, 300)
    assert torch.equal((t[0] + t[1] + t[2]).float(), w)
    assert torch.equal(t[0].float() + t[1].float() + t[2].float(), w)


def test_projection_emulated_in_float64_is_the_fp32_product(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 256, generator=gen) * 0.05)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)

    def mm(a, b, *, out_dtype):  # exact products and sums: the GEMM up to fp32 rounding
        return (a.double() @ b.double()).to(out_dtype)

    monkeypatch.setattr(torch, "mm", mm)
    got = Bf16TermsProjection(linear)(x)
    want = x.double() @ linear.weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (5, 64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)


def test_terms_follow_a_weight_written_in_place_or_replaced(monkeypatch) -> None:
    monkeypatch.setattr(torch, "mm", lambda a, b, *, out_dtype: (a.double() @ b.double()).float())
    linear = nn.Linear(32, 8, bias=False)
    proj = Bf16TermsProjection(linear)
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    before = proj(x)
    with torch.no_grad():
        linear.weight.mul_(2)  # in place (as load() copies): the version counter moves
    assert torch.equal(proj(x), before * 2)
    linear.weight = nn.Parameter(torch.zeros(8, 32))  # replaced
    assert torch.equal(proj(x), torch.zeros(1, 8))


def test_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="fp32"):
        Bf16TermsProjection(nn.Linear(4, 4, bias=False).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias-free"):
        Bf16TermsProjection(nn.Linear(4, 4))


def test_the_cpu_has_no_fp32_out_gemm_so_the_model_keeps_its_path() -> None:
    assert not mm_fp32_out_available(torch.device("cpu"))
