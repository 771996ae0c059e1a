"""Random inputs of the extend indexer's gather and slot selection (``backends.nsa.extend_triton``),
shared by the interpreter tests and the GPU tests."""

from __future__ import annotations

import torch

from backends.deepgemm.fp8 import PAGE

I32 = torch.int32


def random_cache(gen: torch.Generator, pages: int, dim: int) -> torch.Tensor:
    """An index cache of random bytes (keys and scales alike): ``uint8 [pages, 64, 1, D + 4]``."""
    return torch.randint(0, 256, (pages, PAGE, 1, dim + 4), generator=gen, dtype=torch.uint8)


def random_selection(gen: torch.Generator, tokens: int, topk: int, flat: int, scored: bool):
    """``(slots, ks, kv_lens, topk_lens, best)`` as an extend plan and the top-k leave them:
    each token's range ``[ks, ks + kv_len)`` inside ``flat`` entries (clamped reads past it
    included), ``topk_lens = min(kv_len, topk)``, and for a token past top-k its ``best``
    offsets in ``[0, kv_len)``, -1 past a count of them; ``best`` None unless ``scored``."""

    def ints(low: int, high: int, n: int) -> torch.Tensor:
        return torch.randint(low, high, (n,), generator=gen, dtype=torch.int64)

    slots = ints(0, 1 << 20, flat).to(I32)
    kv_lens = ints(1, 2 * topk + 2, tokens)
    ks = torch.minimum(ints(0, flat, tokens), torch.full_like(kv_lens, flat - 1))
    topk_lens = torch.minimum(kv_lens, torch.full_like(kv_lens, topk))
    best = None
    if scored:
        best = torch.full((tokens, topk), -1, dtype=torch.int64)
        for t in range(tokens):
            count = int(torch.randint(0, min(topk, int(kv_lens[t])) + 1, (1,), generator=gen))
            best[t, :count] = torch.randperm(int(kv_lens[t]), generator=gen)[:count]
        best = best.to(I32)
    return slots, ks.to(I32), kv_lens.to(I32), topk_lens.to(I32), best
