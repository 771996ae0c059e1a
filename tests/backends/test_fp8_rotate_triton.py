"""The fp8 kernel's rotated variant (the indexer's Hadamard fused in) against the torch path,
under the Triton interpreter; compiled on the GPU in tests/gpu/test_fp8_triton_gpu.py.

The torch path is ``quantize(bf16((x @ R^T) * scale))``. The kernel forms the same exact
products and sums them in fp32 in another order, so the two are bit-equal whenever those
sums are exact in fp32: cases built that way are compared byte for byte; plain Gaussian
activations are compared for rare last-bit flips only.
"""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.fp8 import quantize_fp8_e4m3_per_vector_reference
from backends.deepgemm.fp8_triton import quantize_fp8_triton, quantize_fp8_weighted_triton

pytestmark = pytest.mark.triton
D = 128
SCALE = D**-0.5


def signs(gen: torch.Generator, n: int = D) -> torch.Tensor:
    """A +-1 matrix (any such matrix: the kernel does not assume Hadamard's structure)."""
    return torch.randint(0, 2, (n, n), generator=gen).float() * 2 - 1


def torch_path(x: torch.Tensor, r: torch.Tensor, scale: float = SCALE):
    y = ((x.float() @ r.t()) * scale).to(torch.bfloat16)
    return quantize_fp8_e4m3_per_vector_reference(y, r.shape[0])


def exact_sum_vectors(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 vectors whose signed sums are exact in fp32 in any order: entries are
    multiples of 2**-7 in [1, 2) times a sign and one power of two per vector."""
    mant = torch.randint(128, 256, shape, generator=gen).float() / 128
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    exp = torch.randint(-20, 20, (*shape[:-1], 1), generator=gen).float()
    return (mant * sign * torch.exp2(exp)).to(torch.bfloat16)


def assert_bytes_equal(got, want) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    a, b = q.view(torch.uint8), q_ref.view(torch.uint8)
    assert torch.equal(a, b), int((a != b).sum())


@pytest.mark.parametrize("shape", [(1, D), (3, 64, D), (5, D), (17, D), (2, 8, D)])
def test_exact_sum_vectors_bit_equal(shape) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    x, r = exact_sum_vectors(gen, shape), signs(gen)
    assert_bytes_equal(
        quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE), torch_path(x, r)
    )


def test_strided_rows_and_smaller_blocks() -> None:
    gen = torch.Generator().manual_seed(7)
    wide = exact_sum_vectors(gen, (9, 3 * D))
    x, r = wide[:, D : 2 * D], signs(gen)  # a column slice: row stride 3 * D
    assert_bytes_equal(
        quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE), torch_path(x, r)
    )
    small = exact_sum_vectors(gen, (20, 64))
    r64 = signs(gen, 64)
    got = quantize_fp8_triton(small, 64, rotation=r64, rotation_scale=64**-0.5)
    assert_bytes_equal(got, torch_path(small, r64, 64**-0.5))


def test_gaussian_activations_differ_at_most_by_rare_last_bit_flips() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, D, generator=gen).to(torch.bfloat16)
    r = signs(gen)
    (q, s), (q_ref, s_ref) = (
        quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE),
        torch_path(x, r),
    )
    assert torch.equal(s, s_ref)
    a, b = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    flips = a != b
    assert flips.float().mean() < 1e-3
    assert ((a - b).abs()[flips] <= 1).all()  # neighbouring fp8 codes only


def test_the_rotated_variant_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(1)
    x, r = exact_sum_vectors(gen, (4, D)), signs(gen)
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_fp8_triton(x.float(), D, rotation=r)
    with pytest.raises(ValueError, match="float32"):
        quantize_fp8_triton(x, D, rotation=r[:64, :64])
    with pytest.raises(ValueError, match="float32"):
        quantize_fp8_triton(x, D, rotation=r.double())
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_triton(exact_sum_vectors(gen, (4, 24)), 24, rotation=signs(gen, 24))


# ---- the query's variant: head weights times the fp8 scale from the same launch --------


@pytest.mark.parametrize("shape", [(1, 4, D), (5, 8, D), (33, 2, D)])
def test_weighted_query_equals_quantize_then_the_torch_multiply(shape) -> None:
    gen = torch.Generator().manual_seed(shape[0] + 50)
    x, r = exact_sum_vectors(gen, shape), signs(gen)
    w = torch.randn(shape[:-1], generator=gen) * torch.exp2(
        torch.randint(-30, 30, shape[:-1], generator=gen).float()
    )
    w[0, 0] = 0.0
    q, s, weighted = quantize_fp8_weighted_triton(x, w, rotation=r, rotation_scale=SCALE)
    assert q.shape == x.shape and s.shape == (*shape[:-1], 1) and weighted.shape == w.shape
    assert_bytes_equal((q, s), torch_path(x, r))
    assert_bytes_equal((q, s), quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE))
    want = w * s.squeeze(-1)
    assert torch.equal(weighted.view(torch.int32), want.view(torch.int32))


def test_weighted_query_without_rotation_and_with_strided_weights() -> None:
    gen = torch.Generator().manual_seed(60)
    x = exact_sum_vectors(gen, (6, 3, D)).float()
    w = torch.randn(3, 6, generator=gen).t()  # not contiguous: copied by the launcher
    q, s, weighted = quantize_fp8_weighted_triton(x, w)
    assert_bytes_equal((q, s), quantize_fp8_e4m3_per_vector_reference(x, D))
    assert torch.equal(weighted, w * s.squeeze(-1))


def test_weighted_query_refuses_mismatched_weights() -> None:
    gen = torch.Generator().manual_seed(61)
    x, r = exact_sum_vectors(gen, (4, 2, D)), signs(gen)
    with pytest.raises(ValueError, match="weights"):
        quantize_fp8_weighted_triton(x, torch.ones(4, 3), rotation=r)
    with pytest.raises(ValueError, match="weights"):
        quantize_fp8_weighted_triton(x, torch.ones(4, 2, dtype=torch.float64), rotation=r)
    q, s, weighted = quantize_fp8_weighted_triton(x[:0], torch.ones(0, 2), rotation=r)
    assert q.shape == (0, 2, D) and s.shape == (0, 2, 1) and weighted.shape == (0, 2)
