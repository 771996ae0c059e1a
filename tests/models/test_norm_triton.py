"""The Triton RMSNorm against the torch formula, under Triton's interpreter on the CPU.

The kernel is what the GPU model runs; here it runs on CPU float32 tensors (the suite sets
``TRITON_INTERPRET=1`` before triton is imported), so its indexing (masked tails of
non-power-of-two widths, row strides of split views, leading dims) is checked without a
GPU. The reference rounds once from float64, the kernel accumulates in fp32: they agree
to a few fp32 ulps, hence a 1e-6 relative tolerance rather than bit equality. The GPU
numerics (bf16, CUDA graphs) are in ``tests/gpu/test_norm_triton_gpu.py``.

Also pinned: the model's CPU norm is still the float64 torch formula, bit for bit, since
the CPU model's exactness tests depend on those bits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common import triton_kernels as tk
from backends.common.triton_kernels import LazyKernel
from dsv32_engine.models.layers import norm_triton
from dsv32_engine.models.layers.norm import RMSNorm, rms_norm_reference
from dsv32_engine.models.layers.norm_triton import rms_norm_triton
from tests.support.kernels import interpretable_stdlib

pytestmark = [pytest.mark.triton, interpretable_stdlib]

RTOL = 1e-6  # fp32 accumulation against a float64 reference rounded to fp32
EPS = 1e-6


def _case(gen: torch.Generator, rows: int, d: int, scale: float = 1.0):
    x = torch.randn(rows, d, generator=gen) * scale
    w = torch.rand(d, generator=gen) * 2.0 - 0.5  # some negative, none exactly 1
    return x, w


def _check(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    out = rms_norm_triton(x, w, eps)
    expected = rms_norm_reference(x, w, eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.is_contiguous()
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=0.0)
    return out


# ----------------------------------------------------------------- shapes and views


@pytest.mark.parametrize("d", [1, 7, 64, 512, 1536, 7168])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_matches_reference(d: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(d * 100 + rows)
    _check(*_case(gen, rows, d))


def test_row_strided_split_view_is_read_in_place() -> None:
    """MLA's latent: the first 512 of each 576-wide ``wkv_a`` row; the rope part after it
    starts mid-row (a pointer 1 KB into the allocation)."""
    gen = torch.Generator().manual_seed(1)
    both = torch.randn(9, 512 + 64, generator=gen)
    latent, rope = both.split([512, 64], dim=-1)
    assert latent.stride(0) == 576 and not latent.is_contiguous()
    for part in (latent, rope):
        w = torch.rand(part.shape[-1], generator=gen) + 0.5
        _check(part, w)


@pytest.mark.parametrize("stride", [10, 12, 13, 16])
def test_row_strides_of_every_alignment(stride: int) -> None:
    """Strides divisible by 4, 2, 1 element(s) and by a whole vector: each alignment hint
    the launcher may give, and none that does not hold."""
    gen = torch.Generator().manual_seed(stride)
    x = torch.randn(6, stride, generator=gen)[:, :7]
    assert x.stride(0) == stride
    _check(x, torch.rand(7, generator=gen) + 0.5)


def test_single_row_with_any_stride() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1003, generator=gen)[:, 5:69]
    _check(x, torch.rand(64, generator=gen))


def test_leading_dims_and_non_unit_feature_stride() -> None:
    gen = torch.Generator().manual_seed(3)
    x3 = torch.randn(2, 3, 40, generator=gen)
    w = torch.rand(40, generator=gen)
    _check(x3, w)  # collapses to a view
    _check(x3[:, 1:], w)  # leading dims that do not collapse: copied first
    _check(torch.randn(40, 5, generator=gen).t(), w)  # features strided: copied first
    _check(torch.randn(40, generator=gen), w)  # one vector, no row dim


def test_empty_inputs_launch_nothing() -> None:
    w = torch.ones(16)
    out = rms_norm_triton(torch.empty(0, 16), w, EPS)
    assert out.shape == (0, 16)
    assert rms_norm_triton(torch.empty(3, 0), torch.ones(0), EPS).shape == (3, 0)


def test_eps_zero_rows_and_tiny_rows() -> None:
    """An all-zero row gives zeros, not NaN (eps keeps the rsqrt finite); a row of tiny
    values is where eps dominates the mean."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 96, generator=gen)
    x[1] = 0.0
    x[2] *= 1e-5
    out = _check(x, torch.rand(96, generator=gen), eps=1e-5)
    assert torch.equal(out[1], torch.zeros(96))


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="shape"):
        rms_norm_triton(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="floating"):
        rms_norm_triton(x.to(torch.int32), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="dimension"):
        rms_norm_triton(torch.tensor(1.0), torch.ones(1), EPS)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    d=st.integers(1, 600),
    pad=st.integers(0, 9),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_random_sweep(rows: int, d: int, pad: int, scale: float, eps: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d + pad, generator=gen)[:, pad:].mul_(scale)  # strided when pad > 0
    _check(x, torch.rand(d, generator=gen) * 3.0 - 1.0, eps=eps)


# ------------------------------------------------------------------ launch settings


def test_kernel_keeps_alignment_and_unspecialises_sizes(monkeypatch) -> None:
    """Row strides and eps change nothing compiled; pointers stay specialised on 16-byte
    alignment, which the vector loads need (see ``LazyKernel``)."""
    seen = {}

    def fake_jit(fn, **keywords):
        seen.update(keywords)
        return {(1,): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    lazy = norm_triton._rms_norm
    LazyKernel(lazy._fn, aligned=lazy._aligned)[(1,)]  # not the module's cached variants
    assert lazy._aligned
    assert seen["do_not_specialize"] == ["x_stride", "eps"]
    assert seen.get("do_not_specialize_on_alignment", []) == []


def test_row_align_is_what_the_stride_allows() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert tk.row_align(576, f32) == 4
    assert tk.row_align(576, bf16) == 8
    assert tk.row_align(7168, bf16) == 8
    assert tk.row_align(10, f32) == 2
    assert tk.row_align(13, bf16) == 1


# ------------------------------------------------------------------- the module path


def _old_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward`` as it was before the kernel, copied here to pin its bits."""
    acc = torch.float64 if x.device.type == "cpu" else torch.float32
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(acc)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_module_keeps_the_torch_formula_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    with torch.no_grad():
        out = norm(x)
    assert torch.equal(out, _old_formula(x, norm.weight, 1e-6))
    assert torch.equal(out, rms_norm_reference(x, norm.weight, 1e-6))


# ----------------------------------------------------------------- residual add fused in


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("d", [7, 512, 7168])
def test_add_then_norm_equals_the_two_launches(dtype: torch.dtype, d: int) -> None:
    """``(h + delta, norm(h + delta))`` bit for bit as the add and the norm launched apart:
    the sum rounds to h's dtype as torch's add does, and the norm reads those bits. (bf16
    is checked compiled, in tests/gpu/test_norm_triton_gpu.py: the interpreter truncates
    fp32 -> bf16 casts where the compiled kernel and torch round to nearest even.)"""
    gen = torch.Generator().manual_seed(d)
    h = (torch.randn(5, d, generator=gen) * 3).to(dtype)
    delta = torch.randn(5, d, generator=gen).to(dtype)
    w = torch.rand(d, generator=gen) + 0.5
    total, normed = norm_triton.add_rms_norm_triton(h, delta, w, EPS)
    want = h + delta
    assert total.dtype == dtype and torch.equal(total, want)
    assert torch.equal(normed, rms_norm_triton(want, w, EPS))


def test_add_then_norm_reads_a_strided_stream() -> None:
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(4, 70, generator=gen)[:, 3:67]
    delta = torch.randn(4, 64, generator=gen)
    w = torch.rand(64, generator=gen)
    total, normed = norm_triton.add_rms_norm_triton(h, delta, w, EPS)
    assert torch.equal(total, h + delta)
    assert torch.equal(normed, rms_norm_triton(h + delta, w, EPS))


def test_add_then_norm_refuses_a_mismatched_delta() -> None:
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="delta must match"):
        norm_triton.add_rms_norm_triton(h, torch.randn(3, 7), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="delta must match"):
        norm_triton.add_rms_norm_triton(h, torch.randn(3, 8).double(), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="16- or 32-bit"):
        norm_triton.add_rms_norm_triton(h.double(), h.double(), torch.ones(8), EPS)


def test_model_residual_step_on_the_cpu_is_the_plain_add_and_norm() -> None:
    """Off CUDA ``add_rms_norm`` is the add and ``RMSNorm`` unchanged (float64 norm bits)."""
    from dsv32_engine.models.layers.residual import add_rms_norm

    gen = torch.Generator().manual_seed(5)
    h, delta = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    norm = RMSNorm(32)
    total, normed = add_rms_norm(h, delta, norm)
    assert torch.equal(total, h + delta)
    assert torch.equal(normed, rms_norm_reference(h + delta, norm.weight, norm.eps))
