"""Paged KV cache and request-to-token map for DeepSeek-V3.2 decode.

Memory is handed out in 64-token pages (the page size deep_gemm's paged MQA
logits kernel is built for). Page 0 is never allocated: it is the *null page*,
and slot 0 the null slot, which padding rows of a CUDA graph write into and
point at, so a padded batch never needs an out-of-range or negative index.
Likewise row 0 of ``RequestPool.req_to_token`` is the null request, all
zeros, that padding requests use.

Allocation is host bookkeeping done by the scheduler between steps; nothing
here runs inside a captured graph.
"""

from __future__ import annotations

import torch

from dsv32_engine.models.config import DSV32Config
from planner.errors import PlanError

NULL_PAGE = 0
NULL_REQUEST = 0


class KVCacheError(PlanError):
    """The KV cache or request pool cannot satisfy a request (exhausted, bad id)."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` tokens."""
    return -(-tokens // page_size)


def cache_bytes(config: DSV32Config, num_pages: int, dtype: torch.dtype) -> int:
    """Bytes a :class:`PagedKVCache` of ``num_pages`` pages holds, by arithmetic (nothing is
    allocated): per layer, the MLA cache's ``kv_cache_dim`` values in ``dtype`` and the index
    cache's ``index_cache_dim`` bytes per token. What a run checks against the device's
    memory before it allocates the cache; equal to ``nbytes()`` of the cache it builds."""
    per_token = config.kv_cache_dim * dtype.itemsize + config.index_cache_dim
    return config.num_hidden_layers * num_pages * config.page_size * per_token


def request_map_bytes(pool_size: int, max_context: int) -> int:
    """Bytes of a :class:`RequestPool`'s ``req_to_token`` (int32 per position per row)."""
    return pool_size * max_context * 4


class _FreeList:
    """Ids ``1..n-1`` (0 reserved), handed out lowest-first, freed ids reused first."""

    def __init__(self, n: int, what: str) -> None:
        self._what = what
        self._free = list(range(n - 1, 0, -1))  # a stack: pop() yields 1, 2, 3, ...
        self._used: set[int] = set()

    def __len__(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def take(self, n: int) -> list[int]:
        if n < 0:
            raise KVCacheError(
                f"cannot allocate a negative number of {self._what}s",
                field=self._what,
                expected=">= 0",
                actual=n,
            )
        if n > len(self._free):
            raise KVCacheError(
                f"out of {self._what}s: {n} requested, {len(self._free)} free, {len(self._used)} in use",
                field=self._what,
                expected=f"<= {len(self._free)}",
                actual=n,
            )
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        ids = [int(i) for i in ids]
        for i in ids:
            if i == 0:
                raise KVCacheError(
                    f"{self._what} 0 is the reserved null {self._what}",
                    field=self._what,
                    expected="> 0",
                    actual=i,
                )
        bad = [i for i in ids if i not in self._used]
        dup = len(set(ids)) != len(ids)
        if bad or dup:
            raise KVCacheError(
                f"freeing {self._what}s that are not allocated (double free?)",
                field=self._what,
                expected="allocated ids, each once",
                actual=bad or ids,
            )
        # All checked first: a bad call changes nothing.
        for i in reversed(ids):
            self._used.remove(i)
            self._free.append(i)


class PagedKVCache:
    """Per-layer MLA and index-key caches over one pool of 64-token pages.

    ``mla[layer]``: ``[num_pages * 64, kv_lora + rope]`` in the model dtype,
    slot ``page * 64 + offset``. ``index[layer]``: ``uint8 [num_pages, 64, 1,
    index_head_dim + 4]`` in deep_gemm's page layout (fp8 keys then fp32
    scales; see ``backends.deepgemm.fp8``). One page id covers both.
    """

    def __init__(
        self,
        config: DSV32Config,
        num_pages: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if num_pages < 2:
            raise KVCacheError(
                "need the null page and at least one more",
                field="num_pages",
                expected=">= 2",
                actual=num_pages,
            )
        self.config = config
        self.page_size = config.page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.dtype = dtype
        slots = num_pages * self.page_size
        self.mla = [
            torch.zeros(slots, config.kv_cache_dim, dtype=dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]
        self.index = [
            torch.zeros(
                num_pages,
                self.page_size,
                1,
                config.index_cache_dim,
                dtype=torch.uint8,
                device=self.device,
            )
            for _ in range(config.num_hidden_layers)
        ]
        self._pages = _FreeList(num_pages, "page")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._pages)

    @property
    def num_used_pages(self) -> int:
        return self._pages.used

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mla_cache, index_cache)`` of layer ``i``."""
        return self.mla[i], self.index[i]

    def alloc(self, n_pages: int) -> list[int]:
        """``n_pages`` page ids (never 0); ``KVCacheError`` if fewer are free."""
        return self._pages.take(n_pages)

    def free(self, pages: list[int]) -> None:
        """Return pages; refuses page 0, unallocated and repeated ids (and then frees none)."""
        self._pages.give(pages)

    def nbytes(self) -> int:
        """Device bytes held by all layers' caches."""
        return sum(t.numel() * t.element_size() for t in self.mla + self.index)


class RequestPool:
    """``req_to_token [pool_size, max_context]`` int32: each request's token slots.

    A request's row lists the physical KV slot of each of its logical token
    positions (0 past its length). The planner gathers ``token_slots``,
    ``page_table`` and ``out_cache_loc`` from it; row 0 is the null request.
    """

    def __init__(
        self,
        pool_size: int,
        max_context: int,
        *,
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if pool_size < 2:
            raise KVCacheError(
                "need the null request and at least one more",
                field="pool_size",
                expected=">= 2",
                actual=pool_size,
            )
        if max_context < 1:
            raise KVCacheError(
                "max_context must be positive",
                field="max_context",
                expected=">= 1",
                actual=max_context,
            )
        self.pool_size = pool_size
        self.max_context = max_context
        self.page_size = page_size
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            pool_size, max_context, dtype=torch.int32, device=self.device
        )
        self._rows = _FreeList(pool_size, "request")

    @property
    def num_free(self) -> int:
        return len(self._rows)

    def alloc(self) -> int:
        """A request row index (never 0); ``KVCacheError`` when the pool is full."""
        return self._rows.take(1)[0]

    def free(self, idx: int) -> None:
        """Release a row and zero it, so stale slots cannot be read through it."""
        self._rows.give([idx])
        self.req_to_token[idx].zero_()

    def assign(self, idx: int, pages: list[int], length: int) -> None:
        """Map the first ``length`` positions of request ``idx`` onto ``pages``.

        Position ``p`` goes to slot ``pages[p // 64] * 64 + p % 64``; positions
        past ``length`` are zeroed. Rewrites the whole row, so growing a request
        is ``assign`` with its longer page list.
        """
        if idx == NULL_REQUEST or not 0 < idx < self.pool_size:
            raise KVCacheError(
                "not an assignable request row",
                field="idx",
                expected=f"1..{self.pool_size - 1}",
                actual=idx,
            )
        if not 0 <= length <= self.max_context:
            raise KVCacheError(
                "length out of range",
                field="length",
                expected=f"0..{self.max_context}",
                actual=length,
            )
        need = pages_for(length, self.page_size)
        if len(pages) < need:
            raise KVCacheError(
                f"{length} tokens need {need} pages",
                field="pages",
                expected=f">= {need}",
                actual=len(pages),
            )
        if any(int(p) == NULL_PAGE for p in pages[:need]):
            raise KVCacheError(
                "the null page cannot hold request tokens",
                field="pages",
                expected="ids > 0",
                actual=list(pages[:need]),
            )
        page_ids = torch.tensor([int(p) for p in pages[:need]], dtype=torch.int64)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        slots = (page_ids[:, None] * self.page_size + offsets[None, :]).flatten()[:length]
        row = torch.zeros(self.max_context, dtype=torch.int32)
        row[:length] = slots.to(torch.int32)
        self.req_to_token[idx].copy_(row)
