"""A tiny paged model and a toy scheduler, shared by the CPU and GPU graph-runner tests.

The model is small but real where the runner can go wrong: several layers
write K/V into a paged cache at ``out_cache_loc`` and attend over it through
``backends.paged.paged_attention``, and a ``meta`` output is an integer
function of every plan field, so a stale or mis-padded field changes it.
"""

from __future__ import annotations

import random

import torch

from backends.paged import paged_attention
from planner import ForwardBatch, ForwardMode, PlanSet


class TinyPagedModel:
    """Embedding, ``layers`` x (paged attention + residual), and an integer digest of the plan."""

    def __init__(
        self,
        slots: int,
        *,
        layers: int = 2,
        heads: int = 2,
        kv_heads: int = 1,
        dim: int = 8,
        vocab: int = 32,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        hidden = heads * dim

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[0] ** 0.5).to(
                device, dtype
            )

        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.embed = w(vocab, hidden)
        self.pos = w(64, hidden)
        self.wq = [w(hidden, heads * dim) for _ in range(layers)]
        self.wk = [w(hidden, kv_heads * dim) for _ in range(layers)]
        self.wv = [w(hidden, kv_heads * dim) for _ in range(layers)]
        self.wo = [w(heads * dim, hidden) for _ in range(layers)]
        self.k_cache = torch.zeros(layers, slots, kv_heads, dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)

    def clone_state(self) -> TinyPagedModel:
        """Same weights, own KV cache: the eager twin of a graph-run model."""
        twin = object.__new__(TinyPagedModel)
        twin.__dict__.update(self.__dict__)
        twin.k_cache, twin.v_cache = self.k_cache.clone(), self.v_cache.clone()
        return twin

    def __call__(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> dict[str, torch.Tensor]:
        plan = plans["paged"]
        rows = inputs["input_ids"].shape[0]
        x = self.embed[inputs["input_ids"]] + self.pos[plan.positions.long() % self.pos.shape[0]]
        loc = plan.out_cache_loc.long()
        for layer in range(len(self.wq)):
            q = (x @ self.wq[layer]).view(rows, self.heads, self.dim)
            k = (x @ self.wk[layer]).view(rows, self.kv_heads, self.dim)
            v = (x @ self.wv[layer]).view(rows, self.kv_heads, self.dim)
            self.k_cache[layer].index_copy_(0, loc, k)
            self.v_cache[layer].index_copy_(0, loc, v)
            attn = paged_attention(
                plan, q, self.k_cache[layer], self.v_cache[layer], self.dim**-0.5
            )
            x = x + attn.reshape(rows, -1) @ self.wo[layer]
        return {"hidden": x, "meta": plan_digest(plans, rows)}


def plan_digest(plans: PlanSet, rows: int) -> torch.Tensor:
    """Per query row, int64 values read from every field of the paged plan (graph-safe)."""
    plan = plans["paged"]
    n = int(plan.next_n)
    req = torch.arange(rows, device=plan.seq_lens.device) // n
    seq = plan.seq_lens.long()[req]
    cols = [
        seq,
        plan.req_pool_indices.long()[req],
        plan.cu_seqlens_k.long()[req],
        plan.cu_seqlens_k.long()[req + 1],
        plan.page_table.long().sum(1)[req],
        (plan.page_table > 0).sum(1)[req],
        plan.token_slots.long().sum(1)[req],
        plan.kv_lens.long(),
        plan.positions.long(),
        plan.out_cache_loc.long(),
        (seq <= plan.max_seq_len).long(),
        torch.full_like(seq, n),
    ]
    return torch.stack(cols, dim=1)


class Scheduler:
    """Requests that grow by one token per decode step (``next_n`` per verify step) and restart.

    Each step picks a random subset of requests, so batch sizes vary, and
    every step's new tokens are written to the KV slots that later steps read.
    """

    def __init__(self, table: torch.Tensor, *, next_n: int, seed: int, vocab: int = 32) -> None:
        self.table = table
        self.host = table.cpu()  # slot look-ups without device reads
        self.next_n = next_n
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.lens = {req: self.rng.randint(0, 8) for req in range(1, self.host.shape[0])}

    def batch(
        self, bs: int, mode: ForwardMode, device: torch.device | str = "cpu"
    ) -> tuple[ForwardBatch, dict]:
        """The next batch of ``bs`` requests in ``mode``, with its ``input_ids``."""
        n = self.next_n if mode is ForwardMode.TARGET_VERIFY else 1
        reqs = self.rng.sample(sorted(self.lens), bs)
        width = self.host.shape[1]
        lens, locs = [], []
        for req in reqs:
            if self.lens[req] + n > width:
                self.lens[req] = self.rng.randint(0, 8)  # finished; a new request took the row
            self.lens[req] += n
            lens.append(self.lens[req])
            locs.extend(self.host[req, self.lens[req] - n : self.lens[req]].tolist())
        ids = torch.tensor(
            [self.rng.randrange(self.vocab) for _ in range(bs * n)], dtype=torch.int64
        )
        batch = ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64),
            req_to_token=self.table,
            out_cache_loc=torch.tensor(locs, dtype=torch.int64),
            mode=mode,
            next_n=n,
        )
        return batch, {"input_ids": ids.to(device)}
