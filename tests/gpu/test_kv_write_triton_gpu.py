"""The fused MLA cache write compiled for the GPU: bit-equal to the unfused CUDA path.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_kv_write_triton.py``)
check indexing; these check what only a compiled kernel shows: that it lays out and sums
the norm exactly as ``rms_norm_triton`` does and rounds like it and the rope kernel (bit
equality with the unfused launches, cat and ``index_put_``, at the model's bf16 shapes),
that ``MLA.write_kv`` takes it on CUDA, that one launch captured in a ``torch.cuda.CUDAGraph``
replays over new rows and slots, and that new row counts compile nothing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers import kv_write_triton, mla  # noqa: E402
from dsv32_engine.models.layers.kv_write_triton import write_latent_kv_triton  # noqa: E402
from dsv32_engine.models.layers.mla import MLA  # noqa: E402
from dsv32_engine.models.layers.norm import rms_norm_reference  # noqa: E402
from dsv32_engine.models.layers.norm_triton import rms_norm_triton  # noqa: E402
from dsv32_engine.models.layers.rope import (  # noqa: E402
    apply_rope_interleaved_torch,
    rope_cos_sin,
    yarn_inv_freq,
)
from dsv32_engine.models.layers.rope_triton import rope_interleaved_triton  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-6
SLOTS = 4096
D, ROPE = 512, 64
TOL = {"rtol": 2**-7, "atol": 1e-6}  # one bf16 ulp, against fp32 math on the same inputs


def _cos_sin(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = DSV32Config.full()
    inv = yarn_inv_freq(ROPE, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    pos = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen)
    return rope_cos_sin(pos.to(DEV), inv)


def _kva(gen: torch.Generator, rows: int, fused: bool) -> torch.Tensor:
    """``wkv_a``'s own output, or its columns of the fused input projection (row stride
    1536 + 576 + 128)."""
    if fused:
        wide = torch.randn(rows, 1536 + D + ROPE + 128, generator=gen).to(DEV, BF16)
        return wide[:, 1536 : 1536 + D + ROPE]
    return torch.randn(rows, D + ROPE, generator=gen).to(DEV, BF16)


def _loc(gen: torch.Generator, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=gen)[:rows].to(DEV, dtype)


def _unfused(kva, w, cos, sin, cache, loc) -> torch.Tensor:
    """The CUDA path the kernel replaces: two Triton launches, cat, cast, index_put."""
    latent, k_rope = kva.split([D, ROPE], dim=-1)
    out = cache.clone()
    out[loc] = torch.cat(
        [rms_norm_triton(latent, w, EPS), rope_interleaved_triton(k_rope, cos, sin)], dim=-1
    ).to(cache.dtype)
    return out


def _weight(gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(D, generator=gen) * 2.0 - 0.5).to(DEV)


@pytest.mark.parametrize("fused", [False, True], ids=["own_gemm", "fused_gemm"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_bit_equal_to_the_unfused_path(rows: int, loc_dtype, fused: bool) -> None:
    gen = torch.Generator().manual_seed(rows + 7 * fused)
    kva = _kva(gen, rows, fused)
    w = _weight(gen)
    cos, sin = _cos_sin(gen, rows)
    loc = _loc(gen, rows, loc_dtype)
    cache = torch.randn(SLOTS, D + ROPE, generator=gen).to(DEV, BF16)
    got = cache.clone()
    write_latent_kv_triton(kva, w, EPS, cos, sin, got, loc)
    want = _unfused(kva, w, cos, sin, cache, loc)
    assert torch.equal(got, want)  # every slot: the written ones and the untouched ones
    # ... and both are right: within one bf16 ulp of fp32 math on the same inputs.
    latent, k_rope = kva.float().split([D, ROPE], dim=-1)
    torch.testing.assert_close(got[loc, :D].float(), rms_norm_reference(latent, w, EPS), **TOL)
    rope = apply_rope_interleaved_torch(k_rope, cos, sin)
    torch.testing.assert_close(got[loc, D:].float(), rope, **TOL)


@pytest.mark.parametrize("scale", [1e-3, 30.0])
def test_bit_equal_at_other_magnitudes(scale: float) -> None:
    gen = torch.Generator().manual_seed(11)
    kva = (_kva(gen, 64, True).float() * scale).to(BF16)
    w, (cos, sin), loc = _weight(gen), _cos_sin(gen, 64), _loc(gen, 64, torch.int64)
    cache = torch.zeros(SLOTS, D + ROPE, device=DEV, dtype=BF16)
    got = cache.clone()
    write_latent_kv_triton(kva, w, EPS, cos, sin, got, loc)
    assert torch.equal(got, _unfused(kva, w, cos, sin, cache, loc))


def test_captured_write_replays_over_new_rows_and_slots() -> None:
    """One launch captured with static inputs; new ``kva``, cos/sin and slots copied in before
    each replay land where an eager write of the same data would put them, bit for bit."""
    rows = 16
    gen = torch.Generator().manual_seed(3)
    w = _weight(gen)
    wide = torch.zeros(rows, 2240, device=DEV, dtype=BF16)
    static_kva = wide[:, 1536 : 1536 + D + ROPE]
    static_cos = torch.zeros(rows, ROPE // 2, device=DEV)
    static_sin = torch.zeros(rows, ROPE // 2, device=DEV)
    static_loc = torch.zeros(rows, device=DEV, dtype=torch.int32)
    cache = torch.zeros(SLOTS, D + ROPE, device=DEV, dtype=BF16)

    def fill(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        fresh = (_kva(g, rows, True), *_cos_sin(g, rows), _loc(g, rows, torch.int32))
        for dst, src in zip((static_kva, static_cos, static_sin, static_loc), fresh, strict=True):
            dst.copy_(src)
        return fresh

    fill(0)
    side = torch.cuda.Stream()  # compile off the capture, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        write_latent_kv_triton(static_kva, w, EPS, static_cos, static_sin, cache, static_loc)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_latent_kv_triton(static_kva, w, EPS, static_cos, static_sin, cache, static_loc)

    for seed in range(1, 5):
        kva, cos, sin, loc = fill(seed)
        before = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, _unfused(kva, w, cos, sin, before, loc))


def _tiny_or_small(name: str) -> MLA:
    with torch.device(DEV):
        torch.manual_seed(0)
        layer = MLA(DSV32Config.preset(name), BF16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.05)
    return layer.requires_grad_(False)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_mla_write_kv_takes_the_kernel_with_the_old_bits(monkeypatch, preset: str) -> None:
    """``MLA.write_kv`` on CUDA launches the fused kernel (and not ``project_kv``), for its
    own ``wkv_a`` and for the fused projection's view, with what the old path stored."""
    layer = _tiny_or_small(preset)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return write_latent_kv_triton(*args, **kwargs)

    gen = torch.Generator().manual_seed(5)
    rows = 16
    x = torch.randn(rows, layer.wkv_a.in_features, generator=gen).to(DEV, BF16)
    inv = torch.rand(layer.rope // 2, generator=gen)
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (rows,), generator=gen).to(DEV), inv)
    loc = torch.randperm(SLOTS, generator=gen)[:rows].to(DEV)
    width = layer.kv_lora + layer.rope

    def old(kva: torch.Tensor | None) -> torch.Tensor:
        cache = torch.zeros(SLOTS, width, device=DEV, dtype=BF16)
        latent, k_rope = layer.project_kv(x, cos, sin, kva)
        cache[loc] = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)
        return cache

    want_own = old(None)
    layer.fuse_projections()
    kva = layer.in_proj(x)[1]
    want_fused = old(kva)

    def refuse(*args, **kwargs):
        raise AssertionError("MLA.write_kv took the unfused path on CUDA")

    monkeypatch.setattr(mla, "write_latent_kv_triton", counted)
    monkeypatch.setattr(MLA, "project_kv", refuse)
    for given, want in ((None, want_own), (kva, want_fused)):
        got = torch.zeros(SLOTS, width, device=DEV, dtype=BF16)
        with torch.no_grad():
            layer.write_kv(x, cos, sin, got, loc, given)
        assert torch.equal(got, want)
    assert len(calls) == 2


def _compiled_variants() -> int:
    jit = kv_write_triton._kv_write._variants.get(False)
    caches = getattr(jit, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled variants elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_new_row_counts_and_slots_reuse_the_compiled_variant() -> None:
    gen = torch.Generator().manual_seed(9)
    w = _weight(gen)
    cache = torch.zeros(SLOTS, D + ROPE, device=DEV, dtype=BF16)

    def write(rows: int, fused: bool) -> None:
        cos, sin = _cos_sin(gen, rows)
        loc = _loc(gen, rows, torch.int64)
        write_latent_kv_triton(_kva(gen, rows, fused), w, EPS, cos, sin, cache, loc)

    write(2, False)
    before = _compiled_variants()
    for rows in (1, 3, 64, 257):
        write(rows, False)
        write(rows, True)
    torch.cuda.synchronize()
    assert _compiled_variants() == before
