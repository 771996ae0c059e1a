"""The fused MLA cache write under Triton's interpreter, against the path it replaces.

Two references. The unfused composition (``rms_norm_triton`` then
``rope_interleaved_triton``, cat, cast, index_put), run under the interpreter too, must be
bit-identical in every dtype: that is the fused kernel's contract, and the interpreter
rounds fp32 to bf16 the same (truncating) way in both. The torch formulas
(``rms_norm_reference``, ``apply_rope_interleaved_torch``) bound the numerics: within one
bf16 ulp for bf16 (the interpreter truncates where the GPU rounds to nearest even), and
the rope part bit-equal for fp32 and fp16. The GPU's own rounding is checked in
``tests/gpu/test_kv_write_triton_gpu.py``.

Layouts are the model's: ``kva`` a column view of the fused input projection (row stride
2240) or of a padded buffer, int32 and int64 slots in any order, 1 to 5 rows.
"""

from __future__ import annotations

import pytest
import torch

from backends.common import triton_kernels as tk
from backends.common.triton_kernels import LazyKernel
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers import kv_write_triton, mla
from dsv32_engine.models.layers.kv_write_triton import write_latent_kv_triton
from dsv32_engine.models.layers.mla import MLA
from dsv32_engine.models.layers.norm import rms_norm_reference
from dsv32_engine.models.layers.norm_triton import rms_norm_triton
from dsv32_engine.models.layers.rope import (
    apply_rope_interleaved_torch,
    rope_cos_sin,
    yarn_inv_freq,
)
from dsv32_engine.models.layers.rope_triton import rope_interleaved_triton
from tests.support.kernels import interpretable_stdlib

pytestmark = [pytest.mark.triton, interpretable_stdlib]

EPS = 1e-6
SLOTS = 12
SENTINEL = -7.0  # what unwritten cache slots hold: any write outside `loc` would show
BF16_ULP = {"rtol": 2**-7, "atol": 1e-6}


def _cos_sin(gen: torch.Generator, rows: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """YaRN cos/sin of random positions for the model's 32 pairs, random values otherwise."""
    if half == 32:
        cfg = DSV32Config.full()
        inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        return rope_cos_sin(torch.randint(0, 163840, (rows,), generator=gen), inv)
    return torch.randn(rows, half, generator=gen), torch.randn(rows, half, generator=gen)


def _kva(gen: torch.Generator, rows: int, width: int, dtype: torch.dtype, layout: str):
    """``kva`` as the model hands it over: its own GEMM's output, or a column view."""
    if layout == "contiguous":
        return torch.randn(rows, width, generator=gen).to(dtype)
    if layout == "fused":  # wq_a 1536 | wkv_a 576 | indexer wk 128, as MLA.in_proj splits it
        return torch.randn(rows, 1536 + width + 128, generator=gen).to(dtype)[:, 1536:-128]
    return torch.randn(rows, width + 11, generator=gen).to(dtype)[:, 5 : 5 + width]  # odd


def _loc(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct slots in a scrambled order (not sorted, not 0..rows-1)."""
    perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))
    return perm[:rows].flip(0).to(dtype)


def _cache(width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((SLOTS, width), SENTINEL, dtype=dtype)


def _unfused(kva, w, cos, sin, cache, loc, d: int) -> torch.Tensor:
    """The CUDA path before the fused kernel, run under the interpreter."""
    latent, k_rope = kva.split([d, kva.shape[1] - d], dim=-1)
    out = cache.clone()
    out[loc] = torch.cat(
        [rms_norm_triton(latent, w, EPS), rope_interleaved_triton(k_rope, cos, sin)], dim=-1
    ).to(cache.dtype)
    return out


def _fused(kva, w, cos, sin, cache, loc) -> torch.Tensor:
    out = cache.clone()
    before = kva.clone()
    write_latent_kv_triton(kva, w, EPS, cos, sin, out, loc)
    assert torch.equal(kva, before)  # read only
    return out


def _untouched(out: torch.Tensor, loc: torch.Tensor) -> None:
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[loc.long()] = False
    assert torch.all(out[keep] == SENTINEL)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("layout", ["contiguous", "fused", "odd"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_bit_identical_to_the_unfused_launchers(rows, dtype, loc_dtype, layout) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + len(layout))
    kva = _kva(gen, rows, 576, dtype, layout)
    w = torch.rand(512, generator=gen) * 2.0 - 0.5
    cos, sin = _cos_sin(gen, rows, 32)
    loc = _loc(rows, loc_dtype, seed=rows)
    cache = _cache(576, dtype)
    got = _fused(kva, w, cos, sin, cache, loc)
    assert torch.equal(got, _unfused(kva, w, cos, sin, cache, loc, 512))
    _untouched(got, loc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_within_the_torch_formulas(rows, dtype) -> None:
    """Norm against the float64 reference (one bf16 ulp; fp32 accumulation otherwise),
    rope bit-equal to the torch formula where the interpreter rounds as torch does."""
    gen = torch.Generator().manual_seed(100 + rows)
    kva = _kva(gen, rows, 576, dtype, "fused")
    w = torch.rand(512, generator=gen) + 0.5
    cos, sin = _cos_sin(gen, rows, 32)
    loc = _loc(rows, torch.int64, seed=7)
    got = _fused(kva, w, cos, sin, _cache(576, dtype), loc)[loc]
    latent, k_rope = kva.split([512, 64], dim=-1)
    norm_tol = {torch.bfloat16: BF16_ULP, torch.float16: {"rtol": 2**-10, "atol": 1e-6}}
    want_norm = rms_norm_reference(latent, w, EPS)
    want_rope = apply_rope_interleaved_torch(k_rope, cos, sin)
    tol = norm_tol.get(dtype, {"rtol": 1e-6, "atol": 0.0})
    torch.testing.assert_close(got[:, :512].float(), want_norm.float(), **tol)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got[:, 512:].float(), want_rope.float(), **BF16_ULP)
    else:
        assert torch.equal(got[:, 512:], want_rope)


def test_other_widths_and_a_wider_cache_dtype() -> None:
    """The tiny config's 32 + 16 row, and a width whose norm and rope blocks are masked
    (40 latent features, 3 rope pairs); an fp32 cache under a bf16 ``kva`` rounds to bf16
    first, as the norm's output and the cat's ``.to`` did."""
    gen = torch.Generator().manual_seed(3)
    for d, half in [(32, 8), (40, 3)]:
        kva = _kva(gen, 3, d + 2 * half, torch.bfloat16, "odd")
        w = torch.rand(d, generator=gen) + 0.5
        cos, sin = _cos_sin(gen, 3, half)
        loc = _loc(3, torch.int32, seed=d)
        cache = _cache(d + 2 * half, torch.float32)
        got = _fused(kva, w, cos, sin, cache, loc)
        assert torch.equal(got, _unfused(kva, w, cos, sin, cache, loc, d))
        _untouched(got, loc)


def test_one_row_of_cos_sin_and_strided_cos_sin_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    kva = _kva(gen, 3, 576, torch.float32, "contiguous")
    w = torch.rand(512, generator=gen)
    loc = _loc(3, torch.int64, seed=4)
    cos1, sin1 = _cos_sin(gen, 1, 32)
    got = _fused(kva, w, cos1, sin1, _cache(576, torch.float32), loc)
    want = apply_rope_interleaved_torch(kva[:, 512:], cos1, sin1)
    assert torch.equal(got[loc, 512:], want)
    both = torch.randn(3, 64, generator=gen)  # cos | sin as column views, row stride 64
    cos, sin = both[:, :32], both[:, 32:]
    got = _fused(kva, w, cos, sin, _cache(576, torch.float32), loc)
    assert torch.equal(got[loc, 512:], apply_rope_interleaved_torch(kva[:, 512:], cos, sin))


def test_no_rows_writes_nothing() -> None:
    cache = _cache(576, torch.bfloat16)
    write_latent_kv_triton(
        torch.empty(0, 576, dtype=torch.bfloat16),
        torch.ones(512),
        EPS,
        torch.empty(0, 32),
        torch.empty(0, 32),
        cache,
        torch.empty(0, dtype=torch.int64),
    )
    assert torch.all(cache == SENTINEL)


def test_bad_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(5)
    kva = torch.randn(2, 576, generator=gen)
    w = torch.ones(512)
    cos, sin = _cos_sin(gen, 2, 32)
    cache = _cache(576, torch.float32)
    loc = torch.tensor([3, 1])
    ok = {"kva": kva, "norm_weight": w, "cos": cos, "sin": sin, "kv_cache": cache, "loc": loc}
    bad = [
        ({"kva": kva.t().contiguous().t()}, "unit feature stride"),
        ({"kva": kva[0]}, "kva must be"),
        ({"norm_weight": torch.ones(575)}, "even rope width"),
        ({"norm_weight": torch.ones(2, 256)}, r"norm_weight must be \[D\]"),
        ({"kv_cache": torch.zeros(SLOTS, 577)}, "kv_cache must be"),
        ({"kv_cache": torch.zeros(577, SLOTS).t()}, "kv_cache must be"),
        ({"cos": cos[:, :31]}, "cos must be"),
        ({"sin": torch.randn(3, 32)}, "sin must be"),
        ({"cos": torch.randn(32, 2).t()}, "unit last stride"),
        ({"loc": loc.float()}, "int32 or int64"),
        ({"loc": loc[:1]}, r"loc must be \[2\]"),
        ({"kva": kva.double()}, "kva must be float32"),
        ({"kv_cache": cache.to(torch.int32)}, "kv_cache must be float32"),
        ({"norm_weight": torch.ones(512, dtype=torch.int32)}, "floating point"),
        ({"loc": torch.tensor([3, 1], device="meta")}, "loc is on meta"),
    ]
    for change, message in bad:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=message):
            write_latent_kv_triton(
                args["kva"], args["norm_weight"], EPS, args["cos"], args["sin"],
                args["kv_cache"], args["loc"],
            )  # fmt: skip
    assert torch.all(cache == SENTINEL)


def test_kernel_keeps_alignment_and_unspecialises_sizes(monkeypatch) -> None:
    """Strides and eps compile nothing new; pointers stay specialised on alignment (the
    norm's vector loads need it, see ``LazyKernel``)."""
    seen = {}

    def fake_jit(fn, **keywords):
        seen.update(keywords)
        return {(1,): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    lazy = kv_write_triton._kv_write
    LazyKernel(lazy._fn, aligned=lazy._aligned)[(1,)]  # not the module's cached variants
    assert lazy._aligned
    assert seen["do_not_specialize"] == [
        "kva_stride", "cache_stride", "cos_stride", "sin_stride", "eps"
    ]  # fmt: skip
    assert seen.get("do_not_specialize_on_alignment", []) == []


# ------------------------------------------------------------------- the module path


def _tiny_mla() -> MLA:
    torch.manual_seed(0)
    layer = MLA(DSV32Config.preset("tiny"), torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer.requires_grad_(False)


def test_cpu_write_kv_keeps_the_torch_path_bit_for_bit(monkeypatch) -> None:
    """The CPU model's cache rows are the float64 norm and the torch rope, as before the
    kernel, for both the separate and the fused projection's ``kva``."""

    def kernel(*args, **kwargs):
        raise AssertionError("the CPU path launched the fused kernel")

    monkeypatch.setattr(mla, "write_latent_kv_triton", kernel)
    layer = _tiny_mla()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, layer.wkv_a.in_features, generator=gen)
    cos, sin = _cos_sin(gen, 3, layer.rope // 2)
    loc = torch.tensor([5, 0, 9], dtype=torch.int32)
    width = layer.kv_lora + layer.rope
    latent, k_rope = layer.project_kv(x, cos, sin)
    want = _cache(width, torch.float32)
    want[loc] = torch.cat([latent, k_rope], dim=-1)
    got = _cache(width, torch.float32)
    layer.write_kv(x, cos, sin, got, loc)
    assert torch.equal(got, want)
    layer.fuse_projections()
    kva = layer.in_proj(x)[1]
    got = _cache(width, torch.float32)
    layer.write_kv(x, cos, sin, got, loc, kva)
    latent, k_rope = layer.project_kv(x, cos, sin, kva)
    want[loc] = torch.cat([latent, k_rope], dim=-1)
    assert torch.equal(got, want)
