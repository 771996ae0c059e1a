"""The fp8 per-vector quantisation kernel bit for bit against the torch recipe, under the
Triton interpreter (compiled on the GPU: tests/gpu/test_fp8_triton_gpu.py, which reuses
the case builders here).

The interpreter runs the kernel's integer fp8 encoding exactly as the GPU does, so fp8
bytes are compared here, not only scales (Triton's own fp8 cast is not exact in the
interpreter, one reason the kernel does not use it). The scale rule is also checked over
whole binades against both devices' torch ratio (CUDA divides by a scalar through its
reciprocal), to show one rule fits both.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepgemm import fp8
from backends.deepgemm.fp8 import (
    _pow2_ceil_scale,
    quantize_fp8_e4m3_per_vector,
    quantize_fp8_e4m3_per_vector_reference,
)
from backends.deepgemm.fp8_triton import quantize_fp8_triton
from planner.errors import PlanError

F32 = torch.float32
NAN, INF = float("nan"), float("inf")
CENTRES = torch.tensor([448.0 * 2.0**k for k in range(-22, 120)], dtype=F32)
"""amax values whose ratio to 448 is exactly 2**k: from the 1e-4 floor to the top of fp32."""


def assert_bit_equal(x: torch.Tensor, block: int = 128) -> None:
    q, s = quantize_fp8_triton(x, block)
    q_ref, s_ref = quantize_fp8_e4m3_per_vector_reference(x, block)
    assert q.shape == q_ref.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == s_ref.shape and s.dtype == F32
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    bad = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert not bad.any(), (x[bad][:8].tolist(), q.view(torch.uint8)[bad][:8].tolist())


def from_bits(bits: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(F32)


# ------------------------------------------------------------------ case builders


def random_vectors(gen: torch.Generator, rows: int, groups: int, block: int = 128) -> torch.Tensor:
    """fp32 ``[rows, groups * block]``, each vector at its own magnitude from 1e-9 to 1e9
    (so many scale exponents occur, and the 1e-4 floor)."""
    mags = 10.0 ** (torch.rand(rows, groups, 1, generator=gen) * 18 - 9)
    x = torch.randn(rows, groups, block, generator=gen) * mags
    return x.view(rows, groups * block)


def centre_vectors(gen: torch.Generator) -> torch.Tensor:
    """Vectors whose amax is each of ``CENTRES`` and 1-3 fp32 ulps either side (rows
    ``3 * len(CENTRES)`` onward, ``len(CENTRES)`` of them, are the centres): frexp's
    mantissa == 0.5 case, where the ratio's rounding decides the scale. On a centre the
    amax lands on +-448 exactly, the clamp's edge."""
    bits = CENTRES.view(torch.int32).to(torch.int64)
    near = from_bits(torch.cat([bits + d for d in range(-3, 4)]))
    x = torch.randn(near.numel(), 128, generator=gen)
    x = x / x.abs().amax(dim=1, keepdim=True) * near.unsqueeze(1) * 0.5
    x[:, 7] = near
    x[::2, 7] *= -1
    return x


def tie_vectors() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (ties go to the even code) and
    one fp32 ulp either side of each, both signs, subnormals included; each vector starts
    with 448, so the scale is 1 and values are rounded as they are."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    vals = torch.cat([codes, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    vals = torch.cat([vals, -vals])
    per = 127
    pad = torch.zeros(-(-vals.numel() // per) * per)
    pad[: vals.numel()] = vals
    return torch.cat([torch.full((pad.numel() // per, 1), 448.0), pad.view(-1, per)], dim=1)


def extreme_vectors() -> torch.Tensor:
    """Zero (the floor), below and at the floor, fp32 subnormals, near FLT_MAX, one vector
    over the whole range, tiny negatives that round to -0."""
    floor = torch.tensor(1e-4, dtype=F32)
    x = torch.zeros(10, 128)
    x[1, 0] = -0.0
    x[2] = torch.linspace(-1e-5, 1e-5, 128)
    x[3, 5] = floor
    x[4, 5] = torch.nextafter(floor, torch.tensor(1.0))
    x[5] = from_bits(torch.arange(1, 129))
    x[6] = torch.linspace(-3.4e38, 3.4e38, 128)
    x[7, :] = torch.finfo(F32).max
    x[8] = torch.logspace(-38, 38, 128)
    x[9, ::2] = -(2.0**-40)
    return x


def special_vectors(gen: torch.Generator) -> torch.Tensor:
    """NaN and infinities: torch gives such a vector scale 1 (frexp's exponent 0), an
    infinity clamps to +-448 and a NaN stays NaN."""
    x = torch.randn(6, 128, generator=gen)
    x[0, 3] = NAN
    x[1, 5] = INF
    x[2, 7] = -INF
    x[3, 1] = -NAN
    x[4, :] = NAN
    x[5, 0], x[5, 1] = INF, NAN
    return x


# ------------------------------------------------------------------ dispatch & rules


def test_cpu_path_is_the_torch_recipe_and_never_the_kernel(monkeypatch) -> None:
    def refuse(*_args):
        raise AssertionError("the CPU path must not launch the kernel")

    monkeypatch.setattr(fp8, "quantize_fp8_triton", refuse)
    x = torch.randn(5, 3, 256, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_e4m3_per_vector(x)
    q_ref, s_ref = quantize_fp8_e4m3_per_vector_reference(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert q.shape == (5, 3, 256) and s.shape == (5, 3, 2)


@pytest.mark.parametrize(
    "fn", [quantize_fp8_e4m3_per_vector, quantize_fp8_e4m3_per_vector_reference]
)
def test_checks_are_in_front_of_both_paths(fn) -> None:
    with pytest.raises(PlanError, match="floating point"):
        fn(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(PlanError, match="multiple of the block"):
        fn(torch.ones(2, 100))


def test_scale_rule_holds_over_whole_binades() -> None:
    # The kernel's rule (fp8_triton's docstring): c's exponent, and whether its mantissa
    # passes 1.75. Every fp32 amax of the binades around 448, around the 1e-4 floor and at
    # the top, against frexp of the CPU ratio (c / 448) and the CUDA one (c * fp32(1/448)).
    inverse = torch.tensor(1.0, dtype=F32) / 448
    for exp in (113, 114, 134, 135, 136, 254):
        c = from_bits(torch.arange(exp << 23, (exp + 1) << 23))
        cb = torch.clamp(c, min=1e-4).view(torch.int32)
        rule = (((cb >> 23) - 8 + ((cb & 0x7FFFFF) > 0x600000).int()) << 23).view(F32)
        assert torch.equal(rule, _pow2_ceil_scale(c)), exp
        mantissa, e = torch.frexp(torch.clamp(c, min=1e-4) * inverse)
        cuda = torch.ldexp(torch.ones_like(c), torch.where(mantissa == 0.5, e - 1, e))
        assert torch.equal(rule, cuda), exp


# ------------------------------------------------------------------ kernel, interpreter


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize("groups", [1, 3])
def test_random_vectors_bit_equal(dtype, rows, groups) -> None:
    x = random_vectors(torch.Generator().manual_seed(rows * 10 + groups), rows, groups)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    assert_bit_equal(x.to(dtype))


@pytest.mark.triton
@pytest.mark.parametrize("block", [1, 16, 64, 96, 256])
def test_other_block_sizes(block) -> None:
    x = random_vectors(torch.Generator().manual_seed(block), 9, 2, block)
    assert_bit_equal(x.to(torch.bfloat16), block)
    assert_bit_equal(x, block)


@pytest.mark.triton
def test_amax_on_and_around_448_times_powers_of_two() -> None:
    x = centre_vectors(torch.Generator().manual_seed(1))
    assert_bit_equal(x)
    assert_bit_equal(x.to(torch.bfloat16))
    q, s = quantize_fp8_triton(x[3 * len(CENTRES) : 4 * len(CENTRES)], 128)
    assert (q.float().abs().amax(dim=1) == 448).all()
    assert torch.equal(s.squeeze(1), CENTRES / 448)


@pytest.mark.triton
def test_zero_floor_tiny_and_huge_vectors() -> None:
    x = extreme_vectors()
    assert_bit_equal(x)
    assert_bit_equal(x.to(torch.bfloat16))  # FLT_MAX rounds to inf in bf16
    bf16_max = torch.finfo(torch.bfloat16).max
    assert_bit_equal(torch.linspace(-bf16_max, bf16_max, 256).to(torch.bfloat16))
    q, s = quantize_fp8_triton(x, 128)
    assert s[0].item() == s[2].item() == 2.0**-22  # the floor: 2**ceil(log2(1e-4 / 448))
    assert q.view(torch.uint8)[1, 0] == 0x80 and (q.view(torch.uint8)[9, ::2] == 0x80).all()


@pytest.mark.triton
def test_fp8_rounding_ties_and_neighbours_at_scale_one() -> None:
    x = tie_vectors()
    assert_bit_equal(x)
    q, s = quantize_fp8_triton(x, 128)
    assert (s == 1).all()
    # 1.0625 is halfway between 1.0 (even code 0x38) and 1.125: it goes to 1.0;
    # 1.1875, halfway between 1.125 and 1.25 (even code 0x3A), goes up.
    assert q.float()[x == 1.0625].unique().tolist() == [1.0]
    assert q.float()[x == 1.1875].unique().tolist() == [1.25]


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_and_inf_vectors_bit_equal() -> None:
    x = special_vectors(torch.Generator().manual_seed(3))
    assert_bit_equal(x)
    assert_bit_equal(x.to(torch.bfloat16))
    _, s = quantize_fp8_triton(x, 128)
    assert (s == 1).all()


@pytest.mark.triton
def test_strided_and_awkward_layouts() -> None:
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(12, 3 * 128 + 36, generator=gen).to(torch.bfloat16)
    assert_bit_equal(wide[:, 36 : 36 + 256])  # row stride 420: 4-element alignment only
    assert_bit_equal(wide[:, 3 : 3 + 256])  # odd start
    assert_bit_equal(wide[::3, :128])  # every third row
    base = torch.randn(4, 8, 5, 128, generator=gen)
    assert_bit_equal(base[:, :, 2])  # [4, 8, 128]: leading dims collapse to one stride
    assert_bit_equal(base[:, :5, 1:3])  # [4, 5, 2, 128]: they do not; the launcher copies
    assert_bit_equal(base.transpose(0, 1)[:, :, 0])  # transposed leading dims
    assert_bit_equal(torch.randn(256, 3, generator=gen).t())  # feature stride 3: a copy
    assert_bit_equal(torch.randn(256, generator=gen))  # 1-D: one row
    assert_bit_equal(torch.randn(1, 128, generator=gen).expand(5, 128))  # row stride 0
    q, s = quantize_fp8_triton(torch.empty(0, 3, 256), 128)
    assert q.shape == (0, 3, 256) and s.shape == (0, 3, 2)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, sNaN
@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["bits", "binade", "zero", "special"]), min_size=1, max_size=6),
    exponent=st.integers(-40, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_arbitrary_fp32_bit_patterns(kinds, exponent, seed) -> None:
    # Rows of any fp32 at all (NaN payloads, infinities, subnormals, both zeros), rows of
    # random mantissas in 4 binades from 2**exponent (vectors of one size, as real data
    # is), zero rows and rows of only non-finite values, in any mix.
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2**32, (len(kinds), 128), generator=gen, dtype=torch.int64)
    for r, kind in enumerate(kinds):
        if kind == "binade":
            exp = 127 + exponent + ((words[r] >> 23) & 3)
            words[r] = (words[r] & 0x807FFFFF) | (exp << 23)
        elif kind == "zero":
            words[r] &= 0x80000000
        elif kind == "special":
            words[r] = (words[r] & 0x807FFFFF) | 0x7F800000
    x = from_bits(words)
    assert_bit_equal(x)
    assert_bit_equal(x.to(torch.bfloat16))
