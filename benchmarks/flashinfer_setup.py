"""Inputs of benchmarks/verify_flashinfer.py: token tables, random batches, one planner's setup.

Batches come as a scheduler hands them over (host lengths, shuffled whole pages per
request) with sizes biased to the capture edges, where padding goes wrong first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from backends.flashinfer import flashinfer_decode_attention, flashinfer_mla_attention
from benchmarks.flashinfer_configs import Config
from planner import ForwardBatch, Limits, Planner

LENGTH_KINDS = ("uniform", "short", "long", "equal")


def make_table(rows: int, max_context: int, page_size: int, seed: int) -> torch.Tensor:
    """req_to_token: row 0 the null request (slot 0), other rows own shuffled whole pages."""
    pages = -(-max_context // page_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm((rows - 1) * pages, generator=g).view(rows - 1, pages) + 1
    slots = ids[:, :, None] * page_size + torch.arange(page_size)
    table = torch.zeros(rows, max_context, dtype=torch.int32)
    table[1:] = slots.reshape(rows - 1, -1)[:, :max_context].to(torch.int32)
    return table


def make_lens(rng: random.Random, bs: int, config: Config, kind: str) -> list[int]:
    n, ctx = config.next_n, config.max_context
    if kind == "short":
        return [rng.randint(n, min(ctx, 2 * config.page_size + 3)) for _ in range(bs)]
    if kind == "long":
        return [rng.randint(max(n, ctx // 2), ctx) for _ in range(bs)]
    if kind == "equal":
        return [rng.randint(n, ctx)] * bs
    return [rng.randint(n, ctx) for _ in range(bs)]


def make_batch(
    rng: random.Random, config: Config, table_cpu: torch.Tensor, table: torch.Tensor
) -> ForwardBatch:
    """A valid batch with host inputs, as a scheduler hands it over; sizes hit capture edges."""
    edges = [s + d for s in config.sizes for d in (0, 1) if 1 <= s + d <= config.max_batch]
    bs = rng.choice(edges) if rng.random() < 0.3 else rng.randint(1, config.max_batch)
    lens = make_lens(rng, bs, config, rng.choice(LENGTH_KINDS))
    reqs = rng.sample(range(1, table_cpu.shape[0]), bs)
    n = config.next_n
    cols = torch.tensor([[length - n + i for i in range(n)] for length in lens], dtype=torch.int64)
    pool = torch.tensor(reqs, dtype=torch.int64)
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=pool,
        req_to_token=table,
        out_cache_loc=table_cpu[pool[:, None], cols].reshape(-1).contiguous(),
        mode=config.mode,
        next_n=n,
    )


@dataclass
class Setup:
    config: Config
    device: torch.device
    planner: Planner
    table: torch.Tensor
    table_cpu: torch.Tensor
    caches: tuple[torch.Tensor, ...]

    def inputs(self, rows: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        c, dev = self.config, self.device
        if c.backend == "flashinfer_decode":
            return (torch.randn(rows, c.heads, c.head_dim, generator=g).to(dev, torch.bfloat16),)
        nope = torch.randn(rows, c.heads, 512, generator=g).to(dev, torch.bfloat16)
        return nope, torch.randn(rows, c.heads, 64, generator=g).to(dev, torch.bfloat16)

    def forward(self, plans: Any, inputs: tuple[torch.Tensor, ...], impl: str) -> torch.Tensor:
        plan = plans[self.config.backend]
        if self.config.backend == "flashinfer_decode":
            return flashinfer_decode_attention(plan, inputs[0], self.caches, impl=impl)
        return flashinfer_mla_attention(plan, *inputs, *self.caches, impl=impl)

    def reference(self, plans: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.forward(plans, tuple(t.float() for t in inputs), "reference")


def build(config: Config, device: torch.device, seed: int) -> Setup:
    limits = Limits(
        max_batch=config.max_batch,
        max_context=config.max_context,
        page_size=config.page_size,
        next_n=config.next_n,
        device=str(device),
    )
    planner = Planner([config.backend], limits, options={config.backend: config.options()})
    table_cpu = make_table(config.max_batch * 2 + 1, config.max_context, config.page_size, seed)
    pages = int(table_cpu.max()) // config.page_size + 1
    g = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    if config.backend == "flashinfer_decode":
        shape = (pages, config.page_size, config.kv_heads, config.head_dim)
        caches = (rand(*shape), rand(*shape))
    else:
        caches = (rand(pages, config.page_size, 512), rand(pages, config.page_size, 64))
    return Setup(config, device, planner, table_cpu.to(device), table_cpu, caches)
