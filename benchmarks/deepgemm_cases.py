"""The random cases of benchmarks/verify_deepgemm.py: per-row lengths, paged index caches.

Kept apart from the checks so the GPU tests (tests/gpu/test_deepgemm_gpu.py) and the
script draw the very same shapes from the same seeds: edge cases come first, then
random ones, and every case carries its own seed so a failure can be rerun alone.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from backends.deepgemm import (
    PAGE,
    SPLIT_KV,
    index_cache_views,
    new_index_cache,
    quantize_fp8_e4m3_per_vector,
    write_index_cache,
)

MAX_LEN_CHOICES = [1, 255, 256, 257, 300, 5000, 65536, 200_000]
KINDS = ["uniform", "equal", "skewed", "splits"]


def make_lens(batch: int, next_n: int, max_len: int, kind: str, seed: int) -> torch.Tensor:
    """CPU int32 ``[batch, next_n]`` per-row causal lengths, all >= 1."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        last = torch.randint(1, max_len + 1, (batch,), generator=g)
    elif kind == "equal":
        last = torch.full((batch,), int(torch.randint(1, max_len + 1, (1,), generator=g)))
    elif kind == "skewed":
        last = torch.randint(1, min(300, max_len) + 1, (batch,), generator=g)
        big = torch.randint(0, batch, (max(1, batch // 16),), generator=g)
        last[big] = torch.randint(max_len // 2 + 1, max_len + 1, (big.numel(),), generator=g)
    else:  # near split boundaries
        m = torch.randint(1, max(2, max_len // SPLIT_KV + 1), (batch,), generator=g) * SPLIT_KV
        last = (m + torch.randint(-1, 2, (batch,), generator=g)).clamp(1, max_len)
    last = last.clamp(min=next_n)  # a planner pads every request to >= next_n tokens
    cols = [last - (next_n - 1 - i) for i in range(next_n)]
    return torch.stack(cols, dim=1).to(torch.int32).contiguous()


def schedule_cases(n: int, seed: int, max_batch: int = 1024) -> list[dict[str, Any]]:
    """Edge cases first, then random ones. Non-132 SM counts use few batch buckets, since
    the metadata kernel is JIT-compiled per (batch rounded up to 32, num_sms)."""
    rng = random.Random(seed)
    cases = [
        dict(batch=1, next_n=1, max_len=200_000, kind="equal", num_sms=132),
        dict(batch=1, next_n=2, max_len=1, kind="equal", num_sms=132),  # 1 unit, 131 idle SMs
        dict(batch=100, next_n=1, max_len=1, kind="equal", num_sms=132),  # total < num_sms
        dict(batch=32, next_n=2, max_len=256, kind="splits", num_sms=132),  # batch == bucket
        dict(batch=min(1024, max_batch), next_n=2, max_len=200_000, kind="uniform", num_sms=132),
        dict(batch=min(1024, max_batch), next_n=1, max_len=200_000, kind="skewed", num_sms=1),
    ]
    small_buckets = [(1, 32), (33, 64), (257, 288), (993, 1024)]
    while len(cases) < n:
        num_sms = rng.choices([132, 1, 8, 78], weights=[7, 1, 1, 1])[0]
        if num_sms == 132:
            pick = rng.random()
            if pick < 0.6:
                batch = rng.randint(1, max_batch)
            elif pick < 0.8:
                batch = rng.choice([1, 2, 31, 32, 33, 64, 65, 1023, 1024])
            else:
                batch = rng.randint(1, 8)
        else:
            lo, hi = rng.choice(small_buckets)
            batch = rng.randint(lo, hi)
        batch = min(batch, max_batch)
        cases.append(
            dict(
                batch=batch,
                next_n=rng.choice([1, 2]),
                max_len=rng.choice(MAX_LEN_CHOICES),
                kind=rng.choice(KINDS),
                num_sms=num_sms,
            )
        )
    for i, c in enumerate(cases):
        c["seed"] = seed * 100_003 + i
    return cases[:n]


def make_logits_inputs(
    batch: int,
    next_n: int,
    heads: int,
    lens: torch.Tensor,
    seed: int,
    device: torch.device,
    dim: int = 128,
) -> tuple[torch.Tensor, ...]:
    """q, a shuffled paged index cache, weights, lens, block table (0 past each request)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-int(n) // PAGE) for n in lens[:, -1].tolist()]
    nb = sum(pages) + 4
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(batch, max(pages) + 1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used : used + p].to(torch.int32)
        used += p
    gd = torch.Generator(device=device).manual_seed(seed)  # bulk data made on the device
    keys = torch.randn(nb * PAGE, dim, generator=gd, device=device)
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(keys)
    k_scale = k_scale * (torch.rand(nb * PAGE, 1, generator=gd, device=device) + 0.05)
    cache = new_index_cache(nb, dim, device=device)
    write_index_cache(cache, torch.arange(nb * PAGE, device=device), k_fp8, k_scale)
    q = torch.randn(batch, next_n, heads, dim, generator=gd, device=device)
    q_fp8, q_scale = quantize_fp8_e4m3_per_vector(q)
    weights = torch.randn(batch * next_n, heads, generator=gd, device=device)
    weights = (weights * q_scale.reshape(batch * next_n, heads)).contiguous()
    return q_fp8, cache, weights, lens.to(device), table.to(device)


def abs_inputs(q_fp8: torch.Tensor, cache: torch.Tensor, weights: torch.Tensor):
    """Sign-cleared copies: the reference over them is the magnitude bound."""
    q_abs = (q_fp8.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    cache_abs = cache.clone()
    k_view, s_view = index_cache_views(cache_abs)
    k_bytes = k_view.view(torch.uint8)
    k_bytes &= 0x7F
    s_view.abs_()
    return q_abs, cache_abs, weights.abs()


def logits_cases(n: int, seed: int, max_tokens: int = 8_000_000) -> list[dict[str, Any]]:
    """One JIT compile per (next_n, heads), so all four combinations appear early."""
    rng = random.Random(seed + 1)
    cases = [
        dict(batch=1, next_n=1, heads=64, max_len=200_000, kind="equal"),
        dict(batch=3, next_n=2, heads=32, max_len=300, kind="uniform"),
        dict(batch=32, next_n=2, heads=64, max_len=4096, kind="uniform"),
        dict(batch=64, next_n=1, heads=32, max_len=4096, kind="splits"),
    ]
    while len(cases) < n:
        max_len = rng.choice([1, 64, 257, 1000, 8192, 32768, 200_000])
        batch = rng.choice([1, 2, 5, 8, 32, 64, 128, 256])
        batch = max(1, min(batch, max_tokens // max_len))
        cases.append(
            dict(
                batch=batch,
                next_n=rng.choice([1, 2]),
                heads=rng.choice([32, 64]),
                max_len=max_len,
                kind=rng.choice(KINDS),
            )
        )
    for i, c in enumerate(cases):
        c["seed"] = seed * 7919 + i
        c["extra_width"] = rng.choice([0, 0, 1, 63, 700])
    return cases[:n]
