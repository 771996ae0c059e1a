"""The Triton LayerNorm (and its fused key rope) compiled for the GPU, on CUDA.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_layer_norm_triton.py``)
check the indexing; these check what only a GPU shows:

- accuracy against torch's own CUDA LayerNorm (fp32 Welford moments, fma-contracted
  output) on the same inputs: bf16 outputs within one bf16 ulp and differing in under 1%
  of elements (both round an fp32 value to nearest even; they differ only where their
  fp32 values, a few fp32 ulps apart, straddle a rounding midpoint); fp32 within 1e-5;
- the fused rope bit-equal to the two launches it replaces, compiled (the program's
  store, barrier and reload are what a GPU can get wrong and the interpreter cannot);
- ``LayerNorm.forward`` and the indexer's key path really take the kernel, in one launch;
- a CUDA graph captured around the call replays over new inputs; new row counts and
  strides reuse the compiled variant.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import dsv32_engine.models.layers.norm as norm_module  # noqa: E402
from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers import layer_norm_triton as lnt  # noqa: E402
from dsv32_engine.models.layers.indexer import Indexer  # noqa: E402
from dsv32_engine.models.layers.layer_norm_triton import layer_norm_rope_triton, layer_norm_triton  # noqa: E402
from dsv32_engine.models.layers.norm import LayerNorm, layer_norm_reference  # noqa: E402
from dsv32_engine.models.layers.rope import apply_rope_half_leading, rope_cos_sin, yarn_inv_freq  # noqa: E402
from dsv32_engine.models.layers.rope_triton import rope_half_leading_triton  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-6


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    """``LayerNorm.forward`` fails if it falls back to the torch formula on CUDA; the tests'
    own reference is the function imported above, which this does not touch."""

    def torch_path(*args, **kwargs):
        raise AssertionError("LayerNorm took the torch path on CUDA")

    monkeypatch.setattr(norm_module, "layer_norm_reference", torch_path)


def _norm(d: int, seed: int) -> LayerNorm:
    gen = torch.Generator().manual_seed(seed)
    ln = LayerNorm(d, EPS)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(d, generator=gen) * 2.0 - 0.5)
        ln.bias.copy_(torch.randn(d, generator=gen) * 0.3)
    return ln.to(DEV).requires_grad_(False)  # as the serving model holds it


def _randn(seed: int, *shape: int, scale: float = 1.0, shift: float = 0.0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(device=DEV, dtype=dtype)


def _cos_sin(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = DSV32Config.full()
    inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen)
    return rope_cos_sin(pos.to(DEV), inv)


def _torch_cuda(x: torch.Tensor, ln: LayerNorm) -> torch.Tensor:
    """What ``LayerNorm.forward`` ran on CUDA before the kernel: fp32 F.layer_norm, cast."""
    return layer_norm_reference(x, ln.weight, ln.bias, ln.eps)


def _check_bf16(out: torch.Tensor, x: torch.Tensor, ln: LayerNorm) -> None:
    assert out.dtype == BF16 and out.shape == x.shape and out.is_contiguous()
    want = _torch_cuda(x, ln)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-5)
    assert (out != want).float().mean().item() < 0.01


@pytest.mark.parametrize("rows", [1, 7, 16, 64, 333, 8192])
@pytest.mark.parametrize("scale, shift", [(1e-2, 0.0), (1.0, 0.0), (30.0, 4.0)])
def test_bf16_within_one_ulp_of_torch_cuda(rows: int, scale: float, shift: float) -> None:
    ln = _norm(128, seed=rows)
    x = _randn(rows, rows, 128, scale=scale, shift=shift)
    _check_bf16(ln(x), x, ln)


@pytest.mark.parametrize("d", [128, 512, 7168])
def test_fp32_and_other_widths(d: int) -> None:
    ln = _norm(d, seed=d)
    x = _randn(d, 37, d, scale=3.0, shift=1.0, dtype=torch.float32)
    torch.testing.assert_close(ln(x), _torch_cuda(x, ln), rtol=1e-5, atol=1e-5)
    xb = x.to(BF16)
    _check_bf16(ln(xb), xb, ln)


def test_split_view_of_the_fused_projection() -> None:
    """MLA hands the indexer's ``wk`` output over as a split of one GEMM's 2240-wide rows."""
    ln = _norm(128, seed=1)
    fused = _randn(2, 50, 1536 + 576 + 128)
    k = fused.split([1536, 576, 128], dim=-1)[2]
    _check_bf16(ln(k), k, ln)


@pytest.mark.parametrize("rows", [1, 16, 17, 64, 4096])
def test_fused_rope_is_bit_equal_to_the_two_launches(rows: int) -> None:
    ln = _norm(128, seed=3)
    cos, sin = _cos_sin(rows, rows)
    for x in (_randn(rows, rows, 128, scale=2.0), _randn(rows, rows, 2240)[:, 2112:]):
        fused = ln(x, (cos, sin, 64))
        composed = rope_half_leading_triton(ln(x), cos, sin, 64)
        assert torch.equal(fused.view(torch.int16), composed.view(torch.int16))
        assert torch.equal(fused, apply_rope_half_leading(ln(x), cos, sin, 64))
        direct = layer_norm_rope_triton(x, ln.weight, ln.bias, EPS, cos, sin, 64)
        assert torch.equal(direct, fused)
    x3 = _randn(5, 9, 4, 128)
    cos, sin = _cos_sin(5, 9)
    fused = layer_norm_rope_triton(x3, ln.weight, ln.bias, EPS, cos, sin, 64)
    want = rope_half_leading_triton(layer_norm_triton(x3, ln.weight, ln.bias, EPS), cos, sin, 64)
    assert torch.equal(fused, want)


def _kernels(fn) -> list[str]:
    fn()  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler saw no CUDA activity")
    return names


def test_one_launch_for_the_norm_and_for_norm_plus_rope() -> None:
    ln = _norm(128, seed=4)
    x = _randn(4, 16, 128)
    cos, sin = _cos_sin(4, 16)
    assert len(_kernels(lambda: ln(x))) == 1
    names = _kernels(lambda: ln(x, (cos, sin, 64)))
    assert len(names) == 1 and "layer_norm" in names[0], names


def test_the_indexer_key_path_takes_the_fused_launch(monkeypatch) -> None:
    cfg = DSV32Config.tiny()
    idx = Indexer(cfg, BF16).to(DEV).requires_grad_(False)
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return layer_norm_rope_triton(*args)

    monkeypatch.setattr(norm_module, "layer_norm_rope_triton", spy)
    x, qr = _randn(6, 5, cfg.hidden_size), _randn(7, 5, cfg.q_lora_rank)
    gen = torch.Generator().manual_seed(8)
    cos = torch.randn(5, cfg.qk_rope_head_dim // 2, generator=gen).to(DEV)
    sin = torch.randn(5, cfg.qk_rope_head_dim // 2, generator=gen).to(DEV)
    _, k, _ = idx.project_roped(x, qr, cos, sin)
    assert calls == [(5, 128)]
    want = apply_rope_half_leading(idx.k_norm(idx.wk(x)), cos, sin, cfg.qk_rope_head_dim)
    assert torch.equal(k, want)


def test_captured_call_replays_over_new_inputs() -> None:
    ln = _norm(128, seed=5)
    buffer = torch.zeros(16, 2240, device=DEV, dtype=BF16)
    static_x = buffer[:, 2112:]
    static_cos, static_sin = (t.clone() for t in _cos_sin(0, 16))
    side = torch.cuda.Stream()  # warm up (compile) off the capture, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ln(static_x)
        ln(static_x, (static_cos, static_sin, 64))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed = ln(static_x)
        roped = ln(static_x, (static_cos, static_sin, 64))
    for seed in range(1, 5):
        fresh = _randn(seed, 16, 128, scale=float(seed))
        cos, sin = _cos_sin(seed, 16)
        static_x.copy_(fresh)
        static_cos.copy_(cos)
        static_sin.copy_(sin)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(normed, ln(fresh))
        assert torch.equal(roped, ln(fresh, (cos, sin, 64)))
        _check_bf16(normed, fresh, ln)


def _compiled_variants() -> int:
    jit = lnt._layer_norm._variants.get(False)
    caches = getattr(jit, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled variants elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_new_row_counts_and_strides_reuse_the_compiled_variant() -> None:
    ln = _norm(128, seed=6)
    cos, sin = _cos_sin(6, 300)
    ln(_randn(0, 2, 128))
    ln(_randn(0, 2, 128), (cos[:2], sin[:2], 64))
    before = _compiled_variants()
    for rows in (1, 3, 64, 257):
        ln(_randn(rows, rows, 128))
        ln(_randn(rows, rows, 128), (cos[:rows], sin[:rows], 64))
    wide = _randn(9, 5, 2240)
    ln(wide[:, 2112:])
    ln(wide[:, 2112:], (cos[:5], sin[:5], 64))
    torch.cuda.synchronize()
    assert _compiled_variants() == before
