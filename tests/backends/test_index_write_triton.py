"""The fp8 kernel's index-cache variant (quantise, rotate, store at the slot, one launch)
under the Triton interpreter; compiled on the GPU in tests/gpu/test_index_write_triton_gpu.py.

The claim: the cache holds, byte for byte, what ``quantize_fp8_triton`` followed by
``write_index_cache`` stores today, everywhere (the bytes it must not touch included, so
the caches start as random bytes). With the rotation, the torch path
``quantize(bf16((x @ R^T) * scale))`` is matched too on vectors whose sums are exact in
fp32 (tests/backends/test_fp8_rotate_triton.py explains why only those).
"""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm import fp8
from backends.deepgemm.fp8 import (
    PAGE,
    index_cache_views,
    quantize_fp8_e4m3_per_vector_reference,
    quantize_into_index_cache,
    write_index_cache,
)
from backends.deepgemm.fp8_triton import quantize_fp8_to_cache_triton, quantize_fp8_triton
from planner.errors import PlanError
from tests.backends.test_fp8_rotate_triton import SCALE, exact_sum_vectors, signs, torch_path
from tests.backends.test_fp8_triton import random_vectors

pytestmark = pytest.mark.triton
D = 128
WIDTH = D + 4


def random_cache(gen: torch.Generator, pages: int, pad: int = 0) -> torch.Tensor:
    """A cache of random bytes; ``pad`` bytes after each page (a sliced pool: stride(0)
    larger than one page, which deep_gemm and ``index_cache_views`` allow)."""
    buf = torch.randint(0, 256, (pages, PAGE * WIDTH + pad), generator=gen, dtype=torch.uint8)
    return buf[:, : PAGE * WIDTH].view(pages, PAGE, 1, WIDTH)


def copy_of(cache: torch.Tensor) -> torch.Tensor:
    """A cache over a copy of ``cache``'s whole storage (the padding between pages too),
    with the same strides: the reference writes and the kernel each get their own."""
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(cache.untyped_storage().clone(), cache.storage_offset(), cache.shape, cache.stride())
    return out


def kernel_write(cache, slots, x, rotation=None, scale=SCALE) -> torch.Tensor:
    """The kernel into a copy of ``cache``."""
    out = copy_of(cache)
    codes, scales = index_cache_views(out)
    quantize_fp8_to_cache_triton(
        x, codes.view(torch.uint8), scales, slots, rotation=rotation, rotation_scale=scale
    )
    return out


def storage(cache: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())


def assert_same_storage(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = storage(got), storage(want)
    assert a.shape == b.shape
    bad = a != b
    assert not bad.any(), (int(bad.sum()), bad.nonzero()[:8].flatten().tolist())


def slots_for(gen: torch.Generator, n: int, pages: int, dtype=torch.int32) -> torch.Tensor:
    """``n`` distinct slots in random order over every page (distinct: the torch
    ``index_put_`` leaves duplicates' winner unspecified)."""
    return torch.randperm(pages * PAGE, generator=gen)[:n].to(dtype)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_rotated_keys_land_as_quantize_then_write(rows: int, slot_dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, r = exact_sum_vectors(gen, (rows, D)), signs(gen)
    cache = random_cache(gen, 3)
    slots = slots_for(gen, rows, 3, slot_dtype)
    got = kernel_write(cache, slots, x, r)
    want = copy_of(cache)
    write_index_cache(want, slots, *quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE))
    assert_same_storage(got, want)
    torch_want = copy_of(cache)
    write_index_cache(torch_want, slots, *torch_path(x, r))
    assert_same_storage(got, torch_want)


def test_gaussian_rotated_keys_equal_the_unfused_kernel() -> None:
    """Same dot, same rounding: no exact-sum condition between the two kernel variants."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(33, D, generator=gen).to(torch.bfloat16)
    r, cache, slots = signs(gen), random_cache(gen, 2), slots_for(gen, 33, 2)
    want = copy_of(cache)
    write_index_cache(want, slots, *quantize_fp8_triton(x, D, rotation=r, rotation_scale=SCALE))
    assert_same_storage(kernel_write(cache, slots, x, r), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unrotated_keys_equal_the_torch_recipe(dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    x = random_vectors(gen, 37, 1).to(dtype)
    cache, slots = random_cache(gen, 4), slots_for(gen, 37, 4, torch.int64)
    want = copy_of(cache)
    write_index_cache(want, slots, *quantize_fp8_e4m3_per_vector_reference(x, D))
    assert_same_storage(kernel_write(cache, slots, x, None), want)


def test_page_stride_larger_than_a_page_and_strided_keys() -> None:
    gen = torch.Generator().manual_seed(11)
    for pad in (4, 16, 36):
        cache = random_cache(gen, 3, pad)
        assert cache.stride(0) == PAGE * WIDTH + pad
        wide = exact_sum_vectors(gen, (20, 3 * D))
        x, r = wide[:, D : 2 * D], signs(gen)  # a column slice: row stride 3 * D
        slots = slots_for(gen, 20, 3)
        want = copy_of(cache)
        write_index_cache(want, slots, *torch_path(x, r))
        assert_same_storage(kernel_write(cache, slots, x, r), want)


def test_slots_outside_the_cache_write_nothing() -> None:
    """torch would raise (or, for a negative slot, wrap); the kernel cannot raise, and
    must not write past the cache either: only the valid slots land."""
    gen = torch.Generator().manual_seed(12)
    x, r = exact_sum_vectors(gen, (4, D)), signs(gen)
    cache = random_cache(gen, 2)
    slots = torch.tensor([5, -1, 2 * PAGE, 127], dtype=torch.int32)
    keep = torch.tensor([0, 3])
    want = copy_of(cache)
    write_index_cache(want, slots[keep], *torch_path(x[keep], r))
    assert_same_storage(kernel_write(cache, slots, x, r), want)


def test_the_kernel_refuses_what_it_cannot_run() -> None:
    gen = torch.Generator().manual_seed(13)
    x, cache = exact_sum_vectors(gen, (4, D)), random_cache(gen, 1)
    codes, scales = index_cache_views(cache)
    codes = codes.view(torch.uint8)
    slots = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="codes uint8"):
        quantize_fp8_to_cache_triton(x, codes.view(torch.float8_e4m3fn), scales, slots)
    with pytest.raises(ValueError, match="codes uint8"):
        quantize_fp8_to_cache_triton(x[:, :64], codes, scales, slots)
    with pytest.raises(ValueError, match="slots"):
        quantize_fp8_to_cache_triton(x, codes, scales, slots.float())
    with pytest.raises(ValueError, match="slots"):
        quantize_fp8_to_cache_triton(x, codes, scales, slots[:3])
    with pytest.raises(ValueError, match=r"x \[N, D\]"):
        quantize_fp8_to_cache_triton(x.view(2, 2, D), codes, scales, slots)


# ------------------------------------------------------- fp8.quantize_into_index_cache


def test_the_torch_path_is_quantize_then_write() -> None:
    """Off CUDA the entry point runs the torch recipe: the same bytes as the kernel."""
    gen = torch.Generator().manual_seed(14)
    x, r = exact_sum_vectors(gen, (9, D)), signs(gen)
    cache, slots = random_cache(gen, 2), slots_for(gen, 9, 2)
    got = copy_of(cache)
    quantize_into_index_cache(got, slots, x, rotation=r, rotation_scale=SCALE)
    assert_same_storage(got, kernel_write(cache, slots, x, r))
    plain = copy_of(cache)
    quantize_into_index_cache(plain, slots, x.float())
    assert_same_storage(plain, kernel_write(cache, slots, x.float(), None))


def test_the_entry_point_checks_with_plan_errors(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran on a CPU tensor")

    monkeypatch.setattr(fp8, "quantize_fp8_to_cache_triton", refuse)
    x, cache = torch.randn(3, D), fp8.new_index_cache(1)
    slots = torch.arange(3, dtype=torch.int32)
    with pytest.raises(PlanError, match="uint8"):
        quantize_into_index_cache(cache.float(), slots, x)
    with pytest.raises(PlanError, match="keys"):
        quantize_into_index_cache(cache, slots, x[:, :64])
    with pytest.raises(PlanError, match="keys"):
        quantize_into_index_cache(cache, slots, x.to(torch.int32))
    with pytest.raises(PlanError, match="slots"):
        quantize_into_index_cache(cache, slots[:2], x)
    with pytest.raises(PlanError, match="slots"):
        quantize_into_index_cache(cache, slots.float(), x)
    with pytest.raises(PlanError, match="block stride"):
        bad = torch.zeros(2, PAGE * WIDTH - 4, dtype=torch.uint8)
        quantize_into_index_cache(bad.as_strided((1, PAGE, 1, WIDTH), (2, WIDTH, WIDTH, 1)),
                                  slots, x)  # fmt: skip
    quantize_into_index_cache(cache, slots, x)  # valid: the torch path, no kernel
