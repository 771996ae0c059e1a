"""The random ragged cases of benchmarks/verify_mqa_logits.py and their fp8 inputs.

KV ranges follow the causal prefill pattern (``ks`` = start of the request, ``ke`` =
start + position + 1) most of the time, with random, full, empty and short-window
rows mixed in; every case carries its own seed so a failure can be rerun alone.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from backends.deepgemm import quantize_fp8_e4m3_per_vector

KINDS = ["causal", "causal", "random", "full", "empty", "window"]


def causal_ranges(tokens: int, kv_cap: int, rng: random.Random) -> tuple[list[int], list[int], int]:
    """Request-major extend batch: request b's rows read ``[start_b, start_b + prefix_b + i + 1)``."""
    ks: list[int] = []
    ke: list[int] = []
    start = 0
    while len(ks) < tokens:
        left = tokens - len(ks)
        ext = rng.randint(1, left) if rng.random() < 0.3 else rng.randint(1, max(1, left // 4))
        spare = kv_cap - start - left  # >= 0: every later token still needs one KV token
        prefix = rng.randint(0, spare) if rng.random() < 0.7 else 0
        for i in range(ext):
            ks.append(start)
            ke.append(start + prefix + i + 1)
        start += prefix + ext
    return ks, ke, start


def make_ranges(
    tokens: int, kv_tokens: int, kind: str, rng: random.Random
) -> tuple[list[int], list[int]]:
    if kind == "full":
        return [0] * tokens, [kv_tokens] * tokens
    if kind == "window":
        ke = [rng.randint(1, kv_tokens) for _ in range(tokens)]
        width = rng.choice([1, 2, 3, 64, 257, 2048])
        return [max(0, e - width) for e in ke], ke
    ks, ke = [], []
    for _ in range(tokens):
        a, b = sorted((rng.randint(0, kv_tokens), rng.randint(0, kv_tokens)))
        if kind == "empty" and rng.random() < 0.3:
            b = a
        ks.append(a)
        ke.append(b)
    return ks, ke


def cases(n: int, seed: int, max_tokens: int, max_kv: int) -> list[dict[str, Any]]:
    """Edge cases first (clipped to the limits), then random ones."""
    rng = random.Random(seed)
    edge = [
        dict(tokens=1, kv_tokens=1, heads=64, kind="full"),
        dict(tokens=max_tokens, kv_tokens=max_kv, heads=64, kind="causal"),
        dict(tokens=3, kv_tokens=5, heads=32, kind="random"),  # tokens % (128 // H) != 0
        dict(tokens=max_tokens, kv_tokens=max_tokens, heads=32, kind="causal"),
        dict(tokens=1, kv_tokens=max_kv, heads=32, kind="full"),
        dict(tokens=257, kv_tokens=1000, heads=64, kind="window"),
        dict(tokens=100, kv_tokens=777, heads=64, kind="empty"),
        dict(tokens=2048, kv_tokens=300, heads=32, kind="random"),  # fewer KV than rows
    ]
    out = [
        c | dict(tokens=min(c["tokens"], max_tokens), kv_tokens=min(c["kv_tokens"], max_kv))
        for c in edge
    ]
    while len(out) < n:
        tokens = rng.randint(1, max_tokens) if rng.random() < 0.7 else rng.randint(1, 64)
        out.append(
            dict(
                tokens=tokens,
                kv_tokens=rng.randint(1, max_kv),
                heads=rng.choice([32, 64]),
                kind=rng.choice(KINDS),
            )
        )
    for i, c in enumerate(out):
        c["seed"] = seed * 100_003 + i
        c["extra_width"] = rng.choice([0, 0, 1, 100])
    return out[:n]


def make_inputs(case: dict[str, Any], device: torch.device, dim: int = 128) -> dict[str, Any]:
    """q, (k, k_scale), weights (q's scale folded in, as DeepSeek-V3.2 does), ks, ke."""
    rng = random.Random(case["seed"])
    tokens, kv_tokens = case["tokens"], case["kv_tokens"]
    if case["kind"] == "causal":
        extra = rng.choice([0, 0, 1, 300])  # a static KV capacity past the real KV
        ks, ke, used = causal_ranges(tokens, max(kv_tokens - extra, tokens), rng)
        kv_tokens = used + extra
    else:
        ks, ke = make_ranges(tokens, kv_tokens, case["kind"], rng)
    g = torch.Generator(device=device).manual_seed(case["seed"])
    keys = torch.randn(kv_tokens, dim, generator=g, device=device)
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(keys)
    k_scale = (
        k_scale[:, 0] * (torch.rand(kv_tokens, generator=g, device=device) + 0.05)
    ).contiguous()
    q = torch.randn(tokens, case["heads"], dim, generator=g, device=device)
    q_fp8, q_scale = quantize_fp8_e4m3_per_vector(q)
    weights = torch.randn(tokens, case["heads"], generator=g, device=device) * q_scale[..., 0]
    return dict(
        q=q_fp8,
        kv=(k_fp8, k_scale),
        weights=weights.contiguous(),
        ks=torch.tensor(ks, dtype=torch.int32, device=device),
        ke=torch.tensor(ke, dtype=torch.int32, device=device),
        kv_tokens=kv_tokens,
    )
