"""The Triton LayerNorm (and its fused indexer-key rope) under Triton's interpreter on the CPU.

What is checked here, without a GPU: the indexing (masked tails, several rows a program,
row strides of split views, leading dims, broadcast cos/sin), the numerics against the
torch formula, and the fused rope bit-equal to the two-launch composition it replaces.

Bounds. float32 in and out: the kernel's two-pass fp32 mean and variance against the
float64 formula rounded to fp32, a few fp32 ulps (``rtol = atol = 1e-5`` on outputs of
order one). bfloat16 out: both sides round an fp32 value to bf16 to nearest even (the
kernel does it in integer arithmetic so the interpreter, which would truncate, rounds as
the GPU does), so they differ only where their fp32 values straddle a rounding midpoint:
at most one bf16 ulp, and rarely (the fraction of flipped elements is asserted under
0.5%; it is ~1e-4 in practice). torch on CUDA computes its moments with Welford's update,
which is another fp32 summation, so the same bound holds there (tests/gpu).

The fused rope must be *bit* equal to ``rope_half_leading_triton(layer_norm_triton(x))``,
interpreter truncation of the rope's own bf16 rounding included: both run that rounding
through the same ``.to``.
"""

from __future__ import annotations

import pytest
import torch

from backends.common import triton_kernels as tk
from backends.common.triton_kernels import LazyKernel
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers import layer_norm_triton as lnt
from dsv32_engine.models.layers import norm as norm_module
from dsv32_engine.models.layers.indexer import Indexer
from dsv32_engine.models.layers.layer_norm_triton import layer_norm_rope_triton, layer_norm_triton
from dsv32_engine.models.layers.norm import LayerNorm, layer_norm_reference
from dsv32_engine.models.layers.rope import (
    apply_rope_half_leading_torch,
    rope_cos_sin,
    yarn_inv_freq,
)
from dsv32_engine.models.layers.rope_triton import rope_half_leading_triton
from tests.support.kernels import interpretable_stdlib

pytestmark = [pytest.mark.triton, interpretable_stdlib]

EPS = 1e-6
BF16 = torch.bfloat16
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _params(gen: torch.Generator, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(d, generator=gen) * 2.0 - 0.5, torch.randn(d, generator=gen) * 0.3


def _x(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0):
    return torch.randn(*shape, generator=gen) * scale + shift


def _f64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The exact formula (float64), not yet rounded."""
    return torch.nn.functional.layer_norm(x.double(), (x.shape[-1],), w.double(), b.double(), eps)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps of same-signed values (the order of their bit patterns)."""
    ia, ib = _bits(a).int(), _bits(b).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def _check_bf16(out: torch.Tensor, x: torch.Tensor, w, b, eps: float = EPS) -> None:
    assert out.dtype == BF16 and out.shape == x.shape and out.is_contiguous()
    for want in (_f64(x, w, b, eps).to(BF16), layer_norm_reference(x.float(), w, b, eps).to(BF16)):
        ulps = _ulps_bf16(out, want)
        assert ulps.max() <= 1, int(ulps.max())
        assert (ulps > 0).float().mean() < 5e-3, int((ulps > 0).sum())


def _check_fp32(out: torch.Tensor, x: torch.Tensor, w, b, eps: float = EPS) -> None:
    assert out.dtype == torch.float32 and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, _f64(x, w, b, eps).float(), **FP32_TOL)


def _cos_sin(gen: torch.Generator, rows: int, half: int):
    if half == 32:  # the model's YaRN tables at random positions
        cfg = DSV32Config.full()
        inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        return rope_cos_sin(torch.randint(0, 163840, (rows,), generator=gen), inv)
    return torch.randn(rows, half, generator=gen), torch.randn(rows, half, generator=gen)


# ------------------------------------------------------------------------- the norm


@pytest.mark.parametrize("d", [1, 7, 64, 128, 300, 2048])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_fp32_matches_the_float64_formula(d: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(d * 100 + rows)
    x, (w, b) = _x(gen, rows, d, scale=2.0, shift=0.5), _params(gen, d)
    _check_fp32(layer_norm_triton(x, w, b, EPS), x, w, b)


@pytest.mark.parametrize("d", [128, 96, 512])
def test_bf16_is_within_one_ulp_of_the_torch_formula_and_rarely_off(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    for scale, shift in ((1.0, 0.0), (30.0, 5.0), (1e-2, 0.0)):
        x = _x(gen, 67, d, scale=scale, shift=shift).to(BF16)
        w, b = _params(gen, d)
        _check_bf16(layer_norm_triton(x, w, b, EPS), x, w, b)


def test_fp16_rounds_once_from_fp32() -> None:
    gen = torch.Generator().manual_seed(8)
    x, (w, b) = _x(gen, 9, 128).half(), _params(gen, 128)
    out = layer_norm_triton(x, w, b, EPS)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, _f64(x, w, b).half(), rtol=2**-10, atol=1e-3)


def test_strided_views_leading_dims_and_one_row() -> None:
    """The indexer's key arrives as a split of the fused input projection's rows (MLA's
    ``wq_a + wkv_a + wk`` GEMM): a row stride of 2240 elements, starting mid-row."""
    gen = torch.Generator().manual_seed(1)
    w, b = _params(gen, 128)
    fused = _x(gen, 21, 1536 + 576 + 128).to(BF16)
    k = fused.split([1536, 576, 128], dim=-1)[2]
    assert k.stride(0) == 2240
    _check_bf16(layer_norm_triton(k, w, b, EPS), k, w, b)
    for x in (
        _x(gen, 3, 5, 128),  # collapses to a view
        _x(gen, 3, 6, 128)[:, 1:],  # does not: copied
        _x(gen, 128, 4).t(),  # features strided: copied
        _x(gen, 1, 1000)[:, 7:135],  # one row, any stride
        _x(gen, 128),  # one vector, no row dim
    ):
        _check_fp32(layer_norm_triton(x, w, b, EPS), x, w, b)


@pytest.mark.parametrize("stride", [130, 132, 136])
def test_row_strides_of_every_alignment(stride: int) -> None:
    gen = torch.Generator().manual_seed(stride)
    x = _x(gen, 18, stride).to(BF16)[:, :128]
    w, b = _params(gen, 128)
    _check_bf16(layer_norm_triton(x, w, b, EPS), x, w, b)


def test_constant_rows_give_the_bias_and_eps_is_honoured() -> None:
    gen = torch.Generator().manual_seed(2)
    w, b = _params(gen, 64)
    x = _x(gen, 4, 64)
    x[1] = 3.0  # zero variance: rsqrt(eps) times zero
    x[2] *= 1e-4  # the variance is of the order of eps
    out = layer_norm_triton(x, w, b, 1e-5)
    assert torch.equal(out[1], b)
    _check_fp32(out, x, w, b, eps=1e-5)


def test_empty_inputs_launch_nothing() -> None:
    w, b = torch.ones(16), torch.zeros(16)
    assert layer_norm_triton(torch.empty(0, 16), w, b, EPS).shape == (0, 16)
    cos = torch.empty(0, 4)
    assert layer_norm_rope_triton(torch.empty(0, 16), w, b, EPS, cos, cos, 8).shape == (0, 16)


def test_bad_arguments_are_refused() -> None:
    x, w, b = torch.randn(2, 8), torch.ones(8), torch.zeros(8)
    cos = torch.ones(2, 4)
    with pytest.raises(ValueError, match="weight"):
        layer_norm_triton(x, torch.ones(7), b, EPS)
    with pytest.raises(ValueError, match="bias"):
        layer_norm_triton(x, w, torch.zeros(8, dtype=torch.int32), EPS)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        layer_norm_triton(x.double(), w, b, EPS)
    with pytest.raises(ValueError, match="dimension"):
        layer_norm_triton(torch.tensor(1.0), torch.ones(1), torch.ones(1), EPS)
    with pytest.raises(ValueError, match="rope_dim"):
        layer_norm_rope_triton(x, w, b, EPS, cos, cos, 7)
    with pytest.raises(ValueError, match="cos/sin"):
        layer_norm_rope_triton(x, w, b, EPS, cos, torch.ones(2, 3), 8)
    with pytest.raises(ValueError, match="rows"):
        layer_norm_rope_triton(torch.randn(8), w, b, EPS, cos, cos, 8)


def test_kernel_keeps_alignment_and_unspecialises_sizes(monkeypatch) -> None:
    """Row counts, strides and eps change nothing compiled (no compile mid-serving)."""
    seen = {}

    def fake_jit(fn, **keywords):
        seen.update(keywords)
        return {(1,): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    lazy = lnt._layer_norm
    LazyKernel(lazy._fn, aligned=lazy._aligned)[(1,)]
    assert lazy._aligned
    assert seen["do_not_specialize"] == [
        "vectors", "heads", "x_stride", "cos_stride", "sin_stride", "eps",
    ]  # fmt: skip


# ---------------------------------------------------------------- the fused rope


def _assert_fused_is_the_composition(x, w, b, cos, sin, rope_dim) -> torch.Tensor:
    fused = layer_norm_rope_triton(x, w, b, EPS, cos, sin, rope_dim)
    composed = rope_half_leading_triton(layer_norm_triton(x, w, b, EPS), cos, sin, rope_dim)
    assert fused.shape == x.shape and fused.dtype == x.dtype and fused.is_contiguous()
    assert torch.equal(_bits(fused), _bits(composed)), int((fused != composed).sum())
    return fused


@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fused_rope_is_bit_equal_to_the_two_launches(dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = _params(gen, 128)
    cos, sin = _cos_sin(gen, rows, 32)
    x = _x(gen, rows, 128, scale=3.0).to(dtype)
    fused = _assert_fused_is_the_composition(x, w, b, cos, sin, 64)
    # and it is the norm followed by the rope, up to roundings
    ref = apply_rope_half_leading_torch(_f64(x, w, b).float(), cos, sin, 64)
    torch.testing.assert_close(fused.float(), ref, rtol=2**-7, atol=5e-2)


def test_fused_rope_other_layouts() -> None:
    """The tiny model's 16 of 128, the whole row, a non-power-of-two half, one broadcast
    cos/sin row, a strided key view, and 3-D input whose rows share a cos/sin row."""
    gen = torch.Generator().manual_seed(3)
    w, b = _params(gen, 128)
    x = _x(gen, 19, 128).to(BF16)
    for rope_dim in (16, 128, 24):
        cos, sin = _cos_sin(gen, 19, rope_dim // 2)
        _assert_fused_is_the_composition(x, w, b, cos, sin, rope_dim)
    cos, sin = _cos_sin(gen, 1, 32)
    _assert_fused_is_the_composition(x, w, b, cos, sin, 64)
    k = _x(gen, 19, 2240).to(BF16)[:, 2112:]
    cos, sin = _cos_sin(gen, 19, 32)
    _assert_fused_is_the_composition(k, w, b, cos, sin, 64)
    x3 = _x(gen, 4, 3, 128).to(BF16)
    cos, sin = _cos_sin(gen, 4, 32)
    out = _assert_fused_is_the_composition(x3, w, b, cos, sin, 64)
    for h in range(3):  # head h of row r uses row r's angles
        assert torch.equal(out[:, h], layer_norm_rope_triton(x3[:, h], w, b, EPS, cos, sin, 64))


# ------------------------------------------------------------------- the module


def _old_layer_norm(x: torch.Tensor, ln: LayerNorm) -> torch.Tensor:
    """``LayerNorm.forward`` as it was before the kernel, copied here to pin its bits."""
    acc = torch.float64 if x.device.type == "cpu" else torch.float32
    w, b = ln.weight.to(acc), ln.bias.to(acc)
    return torch.nn.functional.layer_norm(x.to(acc), (x.shape[-1],), w, b, ln.eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_cpu_module_keeps_the_float64_formula_bit_for_bit(monkeypatch, dtype) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on a CPU tensor")

    monkeypatch.setattr(norm_module, "layer_norm_triton", boom)
    monkeypatch.setattr(norm_module, "layer_norm_rope_triton", boom)
    gen = torch.Generator().manual_seed(4)
    ln = LayerNorm(128)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(128, generator=gen) + 0.5)
        ln.bias.copy_(torch.randn(128, generator=gen) * 0.1)
    x = _x(gen, 6, 128).to(dtype)
    cos, sin = _cos_sin(gen, 6, 32)
    with torch.no_grad():
        assert torch.equal(ln(x), _old_layer_norm(x, ln))
        roped = ln(x, (cos, sin, 64))
    assert torch.equal(roped, apply_rope_half_leading_torch(_old_layer_norm(x, ln), cos, sin, 64))


def test_indexer_key_path_on_the_cpu_is_unchanged() -> None:
    """``project_roped``'s key: the old norm, then the old split + rope + cat, bit for bit."""
    cfg = DSV32Config.tiny()
    idx = Indexer(cfg, torch.float32).requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        idx.k_norm.weight.uniform_(0.5, 1.5, generator=gen)
        idx.k_norm.bias.normal_(0, 0.1, generator=gen)
    x = _x(gen, 3, cfg.hidden_size)
    qr = _x(gen, 3, cfg.q_lora_rank)
    cos, sin = _cos_sin(gen, 3, cfg.qk_rope_head_dim // 2)
    _, k, _ = idx.project_roped(x, qr, cos, sin)
    normed = _old_layer_norm(idx.wk(x), idx.k_norm)
    pe, nope = normed.split([cfg.qk_rope_head_dim, 128 - cfg.qk_rope_head_dim], dim=-1)
    c, s = cos, sin
    a, bb = pe.float().chunk(2, dim=-1)
    old = torch.cat([torch.cat([a * c - bb * s, a * s + bb * c], dim=-1), nope], dim=-1)
    assert torch.equal(k, old)
