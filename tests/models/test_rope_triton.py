"""The rope kernels under Triton's interpreter, against the torch formulas they replace.

The interpreter evaluates the kernels' fp32 arithmetic with numpy, one rounding per
operation like torch on the CPU, so float32 and float16 results must be bit-identical
to the torch reference, on the layouts the model hands over: MLA's ``q_rope`` split out
of 192-wide heads, its 2-D ``k_rope`` split out of the 576-wide KV projection, the
indexer's 128-wide heads. bfloat16 is the exception: the interpreter truncates fp32 to
bf16 where the GPU rounds to nearest even, so the roped features are held to one bf16
ulp here (``tests/gpu/test_rope_triton_gpu.py`` checks the GPU's rounding). Shapes stay
small because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers import rope
from dsv32_engine.models.layers.indexer import Indexer
from dsv32_engine.models.layers.rope import (
    apply_rope_half_leading_torch,
    apply_rope_half_torch,
    apply_rope_interleaved_torch,
    rope_cos_sin,
    yarn_inv_freq,
)
from dsv32_engine.models.layers.rope_triton import rope_half_leading_triton, rope_interleaved_triton

pytestmark = pytest.mark.triton


def _cos_sin(gen: torch.Generator, rows: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """YaRN cos/sin of random positions when ``half`` is the model's 32, else random
    values (any cos/sin must go through the same formula)."""
    if half == 32:
        cfg = DSV32Config.full()
        inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        return rope_cos_sin(torch.randint(0, 163840, (rows,), generator=gen), inv)
    return torch.randn(rows, half, generator=gen), torch.randn(rows, half, generator=gen)


def _q_rope(gen, rows, heads, dtype=torch.float32):
    """MLA's query rope part: a split view of ``[rows, heads, 128 + 64]``."""
    q = torch.randn(rows, heads, 192, generator=gen).to(dtype)
    return q.split([128, 64], dim=-1)[1]


def _k_rope(gen, rows, dtype=torch.float32):
    """MLA's key rope part: a split view of the ``[rows, 512 + 64]`` KV projection."""
    kv = torch.randn(rows, 576, generator=gen).to(dtype)
    return kv.split([512, 64], dim=-1)[1]


def _padded(gen, rows, heads, d, dtype=torch.float32):
    """Heads and rows both strided, the view starting mid-allocation."""
    buf = torch.randn(rows, heads + 2, d + 16, generator=gen).to(dtype)
    return buf[:, 1 : heads + 1, 8 : 8 + d]


INTERLEAVED = {
    "q_split_1row": lambda g, dt: _q_rope(g, 1, 5, dt),
    "q_split": lambda g, dt: _q_rope(g, 3, 4, dt),
    "k_split_1row": lambda g, dt: _k_rope(g, 1, dt),
    "k_split": lambda g, dt: _k_rope(g, 19, dt),
    "contiguous_3d": lambda g, dt: torch.randn(2, 3, 64, generator=g).to(dt),
    "padded_strides": lambda g, dt: _padded(g, 3, 3, 64, dt),
    "4d": lambda g, dt: torch.randn(2, 2, 3, 64, generator=g).to(dt),
    "half_not_pow2": lambda g, dt: torch.randn(3, 2, 12, generator=g).to(dt),
}

HALF_LEADING = {
    # (x maker, rope_dim)
    "indexer_q_1row": (lambda g, dt: torch.randn(1, 4, 128, generator=g).to(dt), 64),
    "indexer_q": (lambda g, dt: torch.randn(3, 4, 128, generator=g).to(dt), 64),
    "indexer_k": (lambda g, dt: torch.randn(9, 128, generator=g).to(dt), 64),
    "padded_strides": (lambda g, dt: _padded(g, 2, 3, 128, dt), 64),
    "rope_only": (lambda g, dt: torch.randn(3, 2, 64, generator=g).to(dt), 64),
    "odd_rest": (lambda g, dt: torch.randn(2, 3, 17, generator=g).to(dt), 12),
}

EXACT_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", INTERLEAVED)
def test_interleaved_is_bit_identical_to_torch(case, dtype):
    gen = torch.Generator().manual_seed(0)
    x = INTERLEAVED[case](gen, dtype)
    before = x.clone()
    cos, sin = _cos_sin(gen, x.shape[0], x.shape[-1] // 2)
    got = rope_interleaved_triton(x, cos, sin)
    want = apply_rope_interleaved_torch(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(x, before)  # the input view (and what it is cut from) is untouched


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", HALF_LEADING)
def test_half_leading_is_bit_identical_to_torch(case, dtype):
    gen = torch.Generator().manual_seed(0)
    make, rope_dim = HALF_LEADING[case]
    x = make(gen, dtype)
    cos, sin = _cos_sin(gen, x.shape[0], rope_dim // 2)
    got = rope_half_leading_triton(x, cos, sin, rope_dim)
    want = apply_rope_half_leading_torch(x, cos, sin, rope_dim)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, want)
    if rope_dim == x.shape[-1]:
        assert torch.equal(got, apply_rope_half_torch(x, cos, sin))


def test_random_shapes_match_torch():
    gen = torch.Generator().manual_seed(7)
    for _ in range(6):
        rows = int(torch.randint(1, 6, (), generator=gen))
        heads = int(torch.randint(1, 7, (), generator=gen))
        half = int(torch.randint(1, 20, (), generator=gen))
        extra = int(torch.randint(0, 9, (), generator=gen))
        cos, sin = _cos_sin(gen, rows, half)
        x = torch.randn(rows, heads, 2 * half + 3, generator=gen)[..., 1 : 1 + 2 * half]
        assert torch.equal(
            rope_interleaved_triton(x, cos, sin), apply_rope_interleaved_torch(x, cos, sin)
        )
        x = torch.randn(rows, heads, 2 * half + extra, generator=gen)
        assert torch.equal(
            rope_half_leading_triton(x, cos, sin, 2 * half),
            apply_rope_half_leading_torch(x, cos, sin, 2 * half),
        )


def test_bf16_rounds_once_and_passes_the_rest_through():
    gen = torch.Generator().manual_seed(3)
    cos, sin = _cos_sin(gen, 3, 32)
    for x, ref_fn in [
        (_q_rope(gen, 3, 4, torch.bfloat16), apply_rope_interleaved_torch),
        (_k_rope(gen, 3, torch.bfloat16), apply_rope_interleaved_torch),
    ]:
        got = rope_interleaved_triton(x, cos, sin)
        assert got.dtype == torch.bfloat16
        want = ref_fn(x.float(), cos, sin)  # fp32 math on the same bf16 inputs
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)  # one ulp
    x = torch.randn(3, 4, 128, generator=gen).bfloat16()
    got = rope_half_leading_triton(x, cos, sin, 64)
    want = apply_rope_half_torch(x[..., :64].float(), cos, sin)
    torch.testing.assert_close(got[..., :64].float(), want, rtol=2**-7, atol=1e-6)
    assert torch.equal(got[..., 64:], x[..., 64:])  # copied, never through fp32


def test_one_row_of_cos_sin_broadcasts_like_torch():
    gen = torch.Generator().manual_seed(4)
    cos, sin = _cos_sin(gen, 1, 32)
    x = _q_rope(gen, 3, 2)
    assert torch.equal(
        rope_interleaved_triton(x, cos, sin), apply_rope_interleaved_torch(x, cos, sin)
    )


def test_empty_rows_give_an_empty_result():
    cos, sin = torch.empty(0, 32), torch.empty(0, 32)
    assert rope_interleaved_triton(torch.empty(0, 3, 64), cos, sin).shape == (0, 3, 64)
    assert rope_half_leading_triton(torch.empty(0, 128), cos, sin, 64).shape == (0, 128)


def test_shape_errors():
    x = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_interleaved_triton(x, torch.randn(2, 16), torch.randn(2, 16))
    with pytest.raises(ValueError, match="even"):
        rope_interleaved_triton(torch.randn(2, 7), torch.randn(2, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="rope_dim"):
        rope_half_leading_triton(x, torch.randn(2, 40), torch.randn(2, 40), 80)
    with pytest.raises(RuntimeError):  # 3 rows of cos for 2 rows of x: no broadcast
        rope_interleaved_triton(x, torch.randn(3, 32), torch.randn(3, 32))


def test_cpu_dispatch_stays_on_torch(monkeypatch):
    """Even with the interpreter on, CPU tensors must take the torch formula: the CPU
    model's exactness tests are pinned to it."""

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on a CPU tensor")

    monkeypatch.setattr(rope, "rope_interleaved_triton", boom)
    monkeypatch.setattr(rope, "rope_half_leading_triton", boom)
    gen = torch.Generator().manual_seed(5)
    cos, sin = _cos_sin(gen, 2, 32)
    x = torch.randn(2, 3, 128, generator=gen)
    pe = x[..., :64]
    assert torch.equal(
        rope.apply_rope_interleaved(pe, cos, sin), apply_rope_interleaved_torch(pe, cos, sin)
    )
    assert torch.equal(rope.apply_rope_half(pe, cos, sin), apply_rope_half_torch(pe, cos, sin))
    assert torch.equal(
        rope.apply_rope_half_leading(x, cos, sin, 64),
        torch.cat([apply_rope_half_torch(pe, cos, sin), x[..., 64:]], dim=-1),
    )


def test_indexer_rope_first_is_the_old_split_and_cat():
    cfg = DSV32Config.tiny()  # rope 16 of the indexer's 128
    idx = Indexer(cfg, torch.float32)
    gen = torch.Generator().manual_seed(6)
    cos, sin = _cos_sin(gen, 3, cfg.qk_rope_head_dim // 2)
    for x in (torch.randn(3, cfg.index_n_heads, 128, generator=gen), torch.randn(3, 128)):
        pe, nope = x.split([16, 112], dim=-1)
        old = torch.cat([apply_rope_half_torch(pe, cos, sin), nope], dim=-1)
        assert torch.equal(idx._rope_first(x, cos, sin), old)
        assert torch.equal(rope_half_leading_triton(x, cos, sin, 16), old)
