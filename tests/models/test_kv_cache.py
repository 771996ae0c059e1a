"""Paged KV cache and request pool: null page/row reserved, allocation, slot maps."""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm import PAGE
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import KVCacheError, PagedKVCache, RequestPool, pages_for
from planner.errors import PlanError


@pytest.fixture
def cfg() -> DSV32Config:
    return DSV32Config.tiny()


def test_cache_shapes_and_dtypes(cfg: DSV32Config) -> None:
    cache = PagedKVCache(cfg, 5, dtype=torch.float32)
    assert len(cache.mla) == len(cache.index) == cfg.num_hidden_layers
    assert cache.num_slots == 5 * 64
    assert cache.mla[0].shape == (5 * 64, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache.mla[0].dtype == torch.float32
    assert cache.index[0].shape == (5, 64, 1, cfg.index_head_dim + 4)
    assert cache.index[0].dtype == torch.uint8
    mla, index = cache.layer(2)
    assert mla is cache.mla[2] and index is cache.index[2]
    assert cache.nbytes() == cfg.num_hidden_layers * (5 * 64 * cfg.kv_cache_dim * 4 + 5 * 64 * 132)


def test_null_page_never_allocated(cfg: DSV32Config) -> None:
    cache = PagedKVCache(cfg, 4, dtype=torch.float32)
    pages = cache.alloc(3)
    assert pages == [1, 2, 3]  # lowest first, 0 reserved
    assert cache.num_free_pages == 0 and cache.num_used_pages == 3


def test_exhaustion_error_is_clear_and_changes_nothing(cfg: DSV32Config) -> None:
    cache = PagedKVCache(cfg, 4, dtype=torch.float32)
    cache.alloc(2)
    with pytest.raises(KVCacheError, match="out of pages: 2 requested, 1 free, 2 in use") as e:
        cache.alloc(2)
    assert isinstance(e.value, PlanError) and e.value.field == "page"
    assert cache.num_free_pages == 1
    assert cache.alloc(0) == []
    with pytest.raises(KVCacheError, match="negative"):
        cache.alloc(-1)


def test_free_and_reuse(cfg: DSV32Config) -> None:
    cache = PagedKVCache(cfg, 6, dtype=torch.float32)
    a = cache.alloc(2)
    b = cache.alloc(3)
    assert cache.num_free_pages == 0
    cache.free(a)
    assert cache.num_free_pages == 2
    assert sorted(cache.alloc(2)) == sorted(a)  # freed pages come back
    cache.free(b)
    assert sorted(cache.alloc(3)) == sorted(b)


def test_bad_frees_are_refused_atomically(cfg: DSV32Config) -> None:
    cache = PagedKVCache(cfg, 6, dtype=torch.float32)
    pages = cache.alloc(2)
    with pytest.raises(KVCacheError, match="null page"):
        cache.free([pages[0], 0])
    with pytest.raises(KVCacheError, match="not allocated"):
        cache.free([pages[0], 5])
    with pytest.raises(KVCacheError, match="not allocated"):
        cache.free([pages[0], pages[0]])
    assert cache.num_used_pages == 2  # nothing was freed by the bad calls
    cache.free(pages)
    with pytest.raises(KVCacheError, match="double free"):
        cache.free(pages[:1])


def test_needs_a_page_besides_null(cfg: DSV32Config) -> None:
    with pytest.raises(KVCacheError, match="num_pages"):
        PagedKVCache(cfg, 1)


def test_index_cache_layout_matches_deep_gemm_helpers(cfg: DSV32Config) -> None:
    fp8 = pytest.importorskip("backends.deepgemm.fp8")
    cache = PagedKVCache(cfg, 3, dtype=torch.float32)
    k = torch.randn(5, cfg.index_head_dim)
    k_fp8, k_scale = fp8.quantize_fp8_e4m3_per_vector(k)
    slots = torch.tensor([64, 65, 130, 191, 0], dtype=torch.int32)
    fp8.write_index_cache(cache.index[1], slots, k_fp8, k_scale)
    keys, scales = fp8.unpack_index_kv_cache(cache.index[1])
    assert torch.equal(keys[slots.long()].view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(scales[slots.long()], k_scale.reshape(-1))
    assert not cache.index[0].any()  # other layers untouched


def test_pages_for() -> None:
    assert [pages_for(n, 64) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


# ------------------------------------------------------------------ RequestPool


def test_request_pool_null_row_and_alloc() -> None:
    pool = RequestPool(4, 200, page_size=PAGE)
    assert pool.req_to_token.dtype == torch.int32 and pool.req_to_token.shape == (4, 200)
    ids = [pool.alloc() for _ in range(3)]
    assert ids == [1, 2, 3]
    with pytest.raises(KVCacheError, match="out of requests"):
        pool.alloc()
    pool.free(2)
    assert pool.alloc() == 2
    with pytest.raises(KVCacheError, match="null request"):
        pool.free(0)
    assert not pool.req_to_token[0].any()


def test_assign_writes_slots_page_by_page() -> None:
    pool = RequestPool(3, 200, page_size=PAGE)
    idx = pool.alloc()
    pool.assign(idx, [7, 3], 70)
    row = pool.req_to_token[idx]
    expected = list(range(7 * 64, 8 * 64)) + list(range(3 * 64, 3 * 64 + 6))
    assert row[:70].tolist() == expected
    assert not row[70:].any()
    pool.assign(idx, [7], 10)  # shrinking rewrites the row
    assert row[:10].tolist() == list(range(7 * 64, 7 * 64 + 10)) and not row[10:].any()
    assert not pool.req_to_token[0].any() and not pool.req_to_token[2].any()


def test_assign_errors() -> None:
    pool = RequestPool(3, 100, page_size=PAGE)
    idx = pool.alloc()
    with pytest.raises(KVCacheError, match="need 2 pages"):
        pool.assign(idx, [5], 65)
    with pytest.raises(KVCacheError, match="null page"):
        pool.assign(idx, [0], 3)
    with pytest.raises(KVCacheError, match="length"):
        pool.assign(idx, [1, 2], 101)
    with pytest.raises(KVCacheError, match="request row"):
        pool.assign(0, [1], 3)


def test_free_zeroes_the_row() -> None:
    pool = RequestPool(3, 100, page_size=PAGE)
    idx = pool.alloc()
    pool.assign(idx, [4], 10)
    pool.free(idx)
    assert not pool.req_to_token[idx].any()
    with pytest.raises(KVCacheError, match="not allocated"):
        pool.free(idx)
