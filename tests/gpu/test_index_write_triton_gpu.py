"""The fp8 kernel's fused outputs compiled for the GPU: keys stored straight into the index
cache, and the query's head weights times its scale; on CUDA.

Skipped cleanly without CUDA. The interpreter tests (tests/backends/test_index_write_triton.py
and tests/backends/test_fp8_rotate_triton.py) check the addressing; these check the compiled
kernel against the launches it replaces, on the same CUDA tensors: the cache's bytes equal
to ``quantize_fp8_triton(..., rotation=)`` + ``write_index_cache`` everywhere (the bytes
around the written slots included), also for Gaussian keys (the same dot and rounding in
both variants); equal to the torch rotation on exact sums; ``Indexer.forward``'s fused
path equal to its unfused one; one launch each; and CUDA-graph replay over new data.
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends.deepgemm import fp8  # noqa: E402
from backends.deepgemm.fp8 import (  # noqa: E402
    PAGE,
    quantize_fp8_e4m3_per_vector_reference,
    quantize_into_index_cache,
    write_index_cache,
)
from backends.deepgemm.fp8_triton import (  # noqa: E402
    quantize_fp8_triton,
    quantize_fp8_weighted_triton,
)
from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers import indexer as indexer_module  # noqa: E402
from dsv32_engine.models.layers.hadamard import hadamard_matrix  # noqa: E402
from dsv32_engine.models.layers.indexer import Indexer  # noqa: E402
from tests.backends.test_fp8_rotate_triton import exact_sum_vectors  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
D, HEADS = 128, 64
SCALE = D**-0.5
WIDTH = D + 4


def _cache(pages: int, pad: int = 0, seed: int = 0) -> torch.Tensor:
    """Random bytes, ``pad`` more after each page (a page stride over one page)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (pages, PAGE * WIDTH + pad), generator=gen, dtype=torch.uint8)
    return buf.to(DEV)[:, : PAGE * WIDTH].view(pages, PAGE, 1, WIDTH)


def _copy(cache: torch.Tensor) -> torch.Tensor:
    out = torch.empty(0, dtype=torch.uint8, device=DEV)
    return out.set_(cache.untyped_storage().clone(), cache.storage_offset(), cache.shape,
                    cache.stride())  # fmt: skip


def _storage(cache: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=DEV).set_(cache.untyped_storage())


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = _storage(got) != _storage(want)
    assert not bad.any(), int(bad.sum())


def _slots(seed: int, n: int, pages: int, dtype=torch.int32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pages * PAGE, generator=gen)[:n].to(DEV, dtype)


def _unfused(cache, slots, x, h) -> torch.Tensor:
    want = _copy(cache)
    write_index_cache(want, slots, *quantize_fp8_triton(x, D, rotation=h, rotation_scale=SCALE))
    return want


def _fused(cache, slots, x, h) -> torch.Tensor:
    got = _copy(cache)
    quantize_into_index_cache(got, slots, x, rotation=h, rotation_scale=SCALE)
    return got


@pytest.mark.parametrize("rows", [1, 16, 17, 64, 300, 8192])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_bytes_equal_quantize_then_write(rows: int, slot_dtype) -> None:
    h = hadamard_matrix(D, device=DEV)
    pages = -(-rows // PAGE) + 2
    cache, slots = _cache(pages, seed=rows), _slots(rows, rows, pages, slot_dtype)
    gen = torch.Generator().manual_seed(rows)
    gauss = (torch.randn(rows, D, generator=gen) * 3).to(DEV, BF16)
    _assert_same(_fused(cache, slots, gauss, h), _unfused(cache, slots, gauss, h))
    exact = exact_sum_vectors(gen, (rows, D)).to(DEV)
    torch_want = _copy(cache)
    y = ((exact.float() @ h.t()) * SCALE).to(BF16)
    write_index_cache(torch_want, slots, *quantize_fp8_e4m3_per_vector_reference(y, D))
    _assert_same(_fused(cache, slots, exact, h), torch_want)


@pytest.mark.parametrize("pad", [4, 16, 100])
def test_page_stride_over_a_page_and_a_strided_key_view(pad: int) -> None:
    h = hadamard_matrix(D, device=DEV)
    cache, slots = _cache(3, pad, seed=pad), _slots(pad, 40, 3)
    assert cache.stride(0) == PAGE * WIDTH + pad
    gen = torch.Generator().manual_seed(pad)
    k = (torch.randn(40, 2240, generator=gen)).to(DEV, BF16)[:, 2112:]
    _assert_same(_fused(cache, slots, k, h), _unfused(cache, slots, k, h))


def test_unrotated_keys_and_other_dtypes() -> None:
    cache, slots = _cache(2, seed=3), _slots(3, 50, 2)
    for dtype in (torch.float32, BF16, torch.float16):
        x = torch.randn(50, D, generator=torch.Generator().manual_seed(4)).to(DEV, dtype)
        got = _copy(cache)
        quantize_into_index_cache(got, slots, x)
        want = _copy(cache)
        write_index_cache(want, slots, *quantize_fp8_e4m3_per_vector_reference(x, D))
        _assert_same(got, want)


def test_the_entry_point_launches_the_kernel_on_cuda(monkeypatch) -> None:
    calls = []
    real = fp8.quantize_fp8_to_cache_triton

    def spy(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8, "quantize_fp8_to_cache_triton", spy)
    cache, slots = _cache(1), _slots(0, 4, 1)
    quantize_into_index_cache(cache, slots, torch.randn(4, D, device=DEV, dtype=BF16),
                              rotation=hadamard_matrix(D, device=DEV), rotation_scale=SCALE)  # fmt: skip
    quantize_into_index_cache(cache, slots, torch.randn(4, D, device=DEV, dtype=BF16))
    assert calls == [(4, D), (4, D)]


@pytest.mark.parametrize("rows", [1, 16, 333])
def test_weighted_query_equals_the_torch_multiply(rows: int) -> None:
    h = hadamard_matrix(D, device=DEV)
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, HEADS, D, generator=gen).to(DEV, BF16)
    w = (torch.randn(rows, HEADS, generator=gen) * 0.01).to(DEV)
    q8, s, weighted = quantize_fp8_weighted_triton(q, w, rotation=h, rotation_scale=SCALE)
    q_ref, s_ref = quantize_fp8_triton(q, D, rotation=h, rotation_scale=SCALE)
    assert torch.equal(q8.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    assert torch.equal(weighted.view(torch.int32), (w * s_ref.squeeze(-1)).view(torch.int32))


def _kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler saw no CUDA activity")
    return names


def test_one_launch_each() -> None:
    h = hadamard_matrix(D, device=DEV)
    cache, slots = _cache(1), _slots(0, 16, 1)
    k = torch.randn(16, D, device=DEV, dtype=BF16)
    q = torch.randn(16, HEADS, D, device=DEV, dtype=BF16)
    w = torch.randn(16, HEADS, device=DEV)
    names = _kernels(lambda: quantize_into_index_cache(cache, slots, k, rotation=h,
                                                       rotation_scale=SCALE))  # fmt: skip
    assert len(names) == 1 and "quantize" in names[0], names
    names = _kernels(lambda: quantize_fp8_weighted_triton(q, w, rotation=h, rotation_scale=SCALE))
    assert len(names) == 1 and "quantize" in names[0], names


def test_cuda_graph_replay_over_new_keys_and_slots() -> None:
    h = hadamard_matrix(D, device=DEV)
    rows, pages = 16, 3
    cache = _cache(pages, seed=5)
    static_k = torch.zeros(rows, D, device=DEV, dtype=BF16)
    static_slots = _slots(0, rows, pages)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        quantize_into_index_cache(cache, static_slots, static_k, rotation=h, rotation_scale=SCALE)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_into_index_cache(cache, static_slots, static_k, rotation=h, rotation_scale=SCALE)
    for seed in range(1, 5):
        gen = torch.Generator().manual_seed(seed)
        k = (torch.randn(rows, D, generator=gen) * seed).to(DEV, BF16)
        slots = _slots(seed, rows, pages)
        want = _unfused(cache, slots, k, h)
        static_k.copy_(k)
        static_slots.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(cache, want)


def test_indexer_forward_fused_equals_unfused(monkeypatch) -> None:
    """The fused path's cache bytes, query codes and weights against the path it replaced
    (rotate_quantize, write_index_cache, the torch multiply), through ``Indexer.forward``."""
    cfg = DSV32Config.tiny()
    torch.manual_seed(0)
    idx = Indexer(cfg, BF16).to(DEV).requires_grad_(False)
    with torch.no_grad():
        idx.k_norm.weight.uniform_(0.5, 1.5)
        idx.k_norm.bias.normal_(0, 0.1)
    seen = []
    monkeypatch.setattr(indexer_module, "indexer_topk", lambda plan, q, w, c: seen.append((q, w)))
    rows, pages = 24, 2
    x = torch.randn(rows, cfg.hidden_size, device=DEV, dtype=BF16)
    qr = torch.randn(rows, cfg.q_lora_rank, device=DEV, dtype=BF16)
    half = cfg.qk_rope_head_dim // 2
    cos, sin = torch.randn(rows, half, device=DEV), torch.randn(rows, half, device=DEV)
    plan = types.SimpleNamespace(out_cache_loc=_slots(7, rows, pages))
    cache = _cache(pages, seed=7)
    got = _copy(cache)
    idx(x, qr, cos, sin, plan, got)
    ((q8, weights),) = seen
    q, k, w = idx.project_roped(x, qr, cos, sin)
    want = _copy(cache)
    write_index_cache(want, plan.out_cache_loc, *idx.rotate_quantize(k))
    q_ref, qs = idx.rotate_quantize(q)
    _assert_same(got, want)
    assert torch.equal(q8.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(weights, w * qs.squeeze(-1))
