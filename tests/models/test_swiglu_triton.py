"""The SwiGLU kernel under Triton's interpreter, against torch's formula and roundings.

Under the interpreter the kernel's exp is numpy's (libdevice cannot be interpreted) and its
division numpy's, so the reference here computes ``g / (1 + exp(-g))`` with numpy in fp32
too: with that, fp32 and fp16 results must be bit-identical to "silu in fp32, round to the
dtype, widen, multiply in fp32, round again". bf16 differs only in how the interpreter
rounds (it truncates fp32 to bf16), so bf16 is held bit-identical to the same formula with
both roundings truncating, which pins that there are two roundings and where, and within
one bf16 ulp of the correctly rounded float64 value, which bounds it. The GPU's exp and
rounding are checked in ``tests/gpu/test_swiglu_triton_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends.common import triton_kernels as tk
from backends.common.triton_kernels import LazyKernel
from dsv32_engine.models.layers import swiglu_triton
from dsv32_engine.models.layers.exact import silu
from dsv32_engine.models.layers.ffn import MLP
from dsv32_engine.models.layers.swiglu_triton import silu_mul, silu_mul_triton
from tests.support.kernels import interpretable_stdlib

pytestmark = [pytest.mark.triton, interpretable_stdlib]

BF16 = torch.bfloat16


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the interpreter does it: drop the low 16 bits."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(BF16)


def _numpy_silu(gate: torch.Tensor) -> torch.Tensor:
    g = gate.float().numpy()
    return torch.from_numpy(g / (np.float32(1.0) + np.exp(-g)))


def _interpreter_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's CUDA formula with the interpreter's exp and rounding."""
    act = _numpy_silu(gate)
    if gate.dtype == BF16:
        return _truncate_to_bf16(_truncate_to_bf16(act).float() * up.float())
    return (act.to(gate.dtype).float() * up.float()).to(gate.dtype)


def _fused_halves(gen: torch.Generator, rows: int, inter: int, dtype, scale: float = 4.0):
    """gate and up as ``MLP``'s fused GEMM hands them over: halves of ``[rows, 2 * inter]``."""
    both = (torch.randn(rows, 2 * inter, generator=gen) * scale).to(dtype)
    gate, up = both.split(inter, dim=-1)
    assert gate.stride(0) == 2 * inter
    return gate, up


def _check(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    before = (gate.clone(), up.clone())
    out = silu_mul_triton(gate, up)
    assert out.shape == gate.shape and out.dtype == gate.dtype and out.is_contiguous()
    assert torch.equal(out, _interpreter_formula(gate, up))
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])
    return out


DTYPES = [torch.float32, torch.float16, BF16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1, 7, 256, 1000, 2048 + 3])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fused_halves_match_the_formula(rows: int, inter: int, dtype) -> None:
    """Widths below, at and across the 1024-column block, odd row strides included."""
    gen = torch.Generator().manual_seed(rows * 1000 + inter)
    _check(*_fused_halves(gen, rows, inter, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_independent_and_leading_dim_inputs(dtype) -> None:
    """The routed experts' separate grouped-GEMM outputs; 3-D and padded views."""
    gen = torch.Generator().manual_seed(1)
    gate = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    up = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    _check(gate, up)
    _check(gate.view(5, 2, 48), up.view(5, 2, 48))
    padded = (torch.randn(4, 3, 50, generator=gen) * 3).to(dtype)
    _check(padded[:, 1:, 1:41], padded[:, 1:, 5:45])  # leading dims that do not collapse
    _check(torch.randn(40, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_extremes() -> None:
    """Large magnitudes (exp overflow and underflow), zeros, signed zeros, infinities."""
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0])
    values = torch.cat([values, torch.tensor([100.0, -100.0, 3e38, -3e38])])
    up = torch.linspace(-3.0, 3.0, values.numel())
    out = _check(values[None], up[None])
    assert out[0, 12] == float("inf")  # 3e38 * 2.5: the product overflows, as in torch
    inf = torch.tensor([[float("inf"), float("-inf")]])
    got = silu_mul_triton(inf, torch.ones(1, 2))
    assert got[0, 0] == float("inf") and torch.isnan(got[0, 1])  # -inf / inf, as torch


@pytest.mark.parametrize("rows", [1, 9])
def test_bf16_within_two_truncations_of_the_exact_value(rows: int) -> None:
    """The bound: each of the two roundings truncates, losing under one bf16 ulp (a relative
    2**-7), so the result is within two of ``silu(g) * up`` in float64; on the GPU each is
    to nearest, half an ulp."""
    gen = torch.Generator().manual_seed(rows)
    gate, up = _fused_halves(gen, rows, 3000, BF16, scale=6.0)
    out = silu_mul_triton(gate, up)
    exact = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), exact, rtol=2**-6, atol=1e-38)
    # The test above would not tell one rounding from two; the formula test does:
    one_rounding = _truncate_to_bf16(_numpy_silu(gate) * up.float())
    assert (out != one_rounding).any()


def test_fp32_and_fp16_within_an_ulp_of_float64() -> None:
    """numpy's fp32 exp is accurate: the formula it feeds stays within a few fp32 ulps of the
    exact silu, so the interpreter reference above is the true formula, not an artefact.
    fp16 products below 2**-14 are subnormal: their ulp is 2**-24 absolute."""
    gen = torch.Generator().manual_seed(2)
    for dtype, rtol, atol in [(torch.float32, 4e-7, 1e-38), (torch.float16, 2**-10, 2**-24)]:
        gate, up = _fused_halves(gen, 4, 2000, dtype)
        out = silu_mul_triton(gate, up)
        want = F.silu(gate.double()).to(dtype).double() * up.double()
        torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)


def test_empty_inputs_launch_nothing() -> None:
    assert silu_mul_triton(torch.empty(0, 16), torch.empty(0, 16)).shape == (0, 16)
    assert silu_mul_triton(torch.empty(3, 0), torch.empty(3, 0)).shape == (3, 0)


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="shapes differ"):
        silu_mul_triton(x, torch.randn(2, 9))
    with pytest.raises(ValueError, match="dtypes differ"):
        silu_mul_triton(x, x.half())
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        silu_mul_triton(x.double(), x.double())
    with pytest.raises(ValueError, match="up is on meta"):
        silu_mul_triton(x, torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match="dimension"):
        silu_mul_triton(torch.tensor(1.0), torch.tensor(1.0))


def test_kernel_keeps_alignment_and_unspecialises_sizes(monkeypatch) -> None:
    """Widths and strides compile nothing new; pointers keep their alignment variant."""
    seen = {}

    def fake_jit(fn, **keywords):
        seen.update(keywords)
        return {(1, 1): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    lazy = swiglu_triton._silu_mul
    LazyKernel(lazy._fn, aligned=lazy._aligned)[(1, 1)]
    assert lazy._aligned
    assert seen["do_not_specialize"] == ["n_cols", "gate_stride", "up_stride"]
    assert seen.get("do_not_specialize_on_alignment", []) == []


# ------------------------------------------------------------------- the module path


def test_cpu_dispatch_keeps_the_float64_silu(monkeypatch) -> None:
    """The CPU model's bits are ``exact.silu`` (rounded once from float64) times ``up``."""

    def kernel(*args, **kwargs):
        raise AssertionError("the CPU path launched the kernel")

    monkeypatch.setattr(swiglu_triton, "silu_mul_triton", kernel)
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        gate, up = _fused_halves(gen, 3, 40, dtype)
        want = F.silu(gate.double()).to(dtype) * up
        assert torch.equal(silu_mul(gate, up), want)
        assert torch.equal(silu_mul(gate, up), silu(gate) * up)


def test_cpu_mlp_keeps_its_bits(monkeypatch) -> None:
    def kernel(*args, **kwargs):
        raise AssertionError("the CPU path launched the kernel")

    monkeypatch.setattr(swiglu_triton, "silu_mul_triton", kernel)
    torch.manual_seed(4)
    mlp = MLP(32, 48, BF16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 32).to(BF16)
    with torch.no_grad():
        want = mlp.w2(silu(mlp.w1(x)) * mlp.w3(x))
        assert torch.equal(mlp(x), want)
        mlp.fuse_projections()
        gate, up = mlp.gate_up(x)
        assert torch.equal(mlp(x), mlp.w2(silu(gate) * up))


def test_autograd_keeps_the_torch_formula() -> None:
    gate = torch.randn(2, 8, requires_grad=True)
    out = silu_mul(gate, torch.randn(2, 8))
    out.sum().backward()
    assert gate.grad is not None
