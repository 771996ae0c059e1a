"""Setups and hostile batches the lanes' tests share (``planner.replay_lane``,
``planner.eager_lane``): each lane must do exactly what the general path does with every
one of them, so both lanes are held to one list."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import torch

from planner import ForwardMode
from tests.support.planners import PlannerSetup

DECODE = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64)
VERIFY = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"next_n": 2}
)
FLASHINFER = PlannerSetup(
    ("flashinfer_decode", "flashinfer_mla"),
    max_batch=4,
    max_context=256,
    page_size=64,
    options={
        "flashinfer_decode": {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        "flashinfer_mla": {"num_heads": 2},
    },
)
NSA_FLASHINFER = PlannerSetup(
    ("nsa", "nsa_flashinfer"),
    max_batch=4,
    max_context=256,
    page_size=64,
    options={
        "nsa": {"topk": 16, "mla_heads": 2, "mla_kernel": "torch"},
        "nsa_flashinfer": {"sparse_topk": 16, "sparse_heads": 2, "sparse_sm_scale": 0.25},
    },
)
CASES = {
    "nsa+paged decode": (DECODE, ForwardMode.DECODE),
    "nsa+paged verify": (VERIFY, ForwardMode.TARGET_VERIFY),
    "flashinfer decode (host ops)": (FLASHINFER, ForwardMode.DECODE),
    "nsa_flashinfer decode (host op)": (NSA_FLASHINFER, ForwardMode.DECODE),
}
BS = 4


class Sub(torch.Tensor):
    """A tensor subclass: the door takes it, the lane leaves it to the general path."""


class Duck:
    """Not a tensor, but answers every question the lane asks of one as the tensor does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def __getattr__(self, name):
        return getattr(self._t, name)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], dim=1)[:, 0]


HOSTILE = {
    "valid": lambda b, t: b,
    "int64 lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu.long()),
    "2-D lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu[None]),
    "strided lengths": lambda b, t: dataclasses.replace(
        b, seq_lens_cpu=noncontiguous(b.seq_lens_cpu)
    ),
    "subclass lengths": lambda b, t: dataclasses.replace(
        b, seq_lens_cpu=b.seq_lens_cpu.as_subclass(Sub)
    ),
    "duck lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=Duck(b.seq_lens_cpu)),
    "duck slots": lambda b, t: dataclasses.replace(b, out_cache_loc=Duck(b.out_cache_loc)),
    "meta lengths": lambda b, t: dataclasses.replace(b, seq_lens_cpu=b.seq_lens_cpu.to("meta")),
    "int16 pool": lambda b, t: dataclasses.replace(
        b, req_pool_indices=b.req_pool_indices.to(torch.int16)
    ),
    "int32 pool": lambda b, t: dataclasses.replace(b, req_pool_indices=b.req_pool_indices.int()),
    "short pool": lambda b, t: dataclasses.replace(b, req_pool_indices=b.req_pool_indices[:-1]),
    "strided pool": lambda b, t: dataclasses.replace(
        b, req_pool_indices=noncontiguous(b.req_pool_indices)
    ),
    "subclass slots": lambda b, t: dataclasses.replace(
        b, out_cache_loc=b.out_cache_loc.as_subclass(Sub)
    ),
    "int32 slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.int()),
    "float slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.float()),
    "long slots": lambda b, t: dataclasses.replace(
        b, out_cache_loc=torch.cat([b.out_cache_loc, b.out_cache_loc[:1]])
    ),
    "repeated slot": lambda b, t: dataclasses.replace(
        b, out_cache_loc=b.out_cache_loc[:1].repeat(b.out_cache_loc.shape[0])
    ),
    "slot out of range": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc + 10**9),
    "meta slots": lambda b, t: dataclasses.replace(b, out_cache_loc=b.out_cache_loc.to("meta")),
    "no positions": lambda b, t: dataclasses.replace(b, positions=None),
    "int64 positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions.long()
    ),
    "wrong positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions + 1
    ),
    "short positions": lambda b, t: dataclasses.replace(
        b, positions=None if b.positions is None else b.positions[:-1]
    ),
    "another table": lambda b, t: dataclasses.replace(b, req_to_token=t.clone()),
    "the table as float": lambda b, t: dataclasses.replace(b, req_to_token=t.view(torch.float32)),
    "the table transposed in place": lambda b, t: dataclasses.replace(
        b, req_to_token=t.as_strided(t.shape, (1, t.shape[0]))
    ),
    "a narrower table": lambda b, t: dataclasses.replace(b, req_to_token=t[:, :-64]),
    "a narrower copy of the table": lambda b, t: dataclasses.replace(
        b, req_to_token=t[:, : t.shape[1] // 4].contiguous()
    ),
    "next_n off": lambda b, t: dataclasses.replace(b, next_n=b.next_n + 1),
    "extend lengths given": lambda b, t: dataclasses.replace(
        b, extend_lens_cpu=torch.full_like(b.seq_lens_cpu, b.next_n)
    ),
    "device lengths given": lambda b, t: dataclasses.replace(b, seq_lens=b.seq_lens_cpu.clone()),
    "int64 device lengths": lambda b, t: dataclasses.replace(b, seq_lens=b.seq_lens_cpu.long()),
    "device extend lengths alone": lambda b, t: dataclasses.replace(
        b, extend_lens=torch.full_like(b.seq_lens_cpu, b.next_n)
    ),
    "mode as a string": lambda b, t: dataclasses.replace(b, mode=b.mode.value),
    "unhashable mode": lambda b, t: dataclasses.replace(b, mode=[b.mode]),
    "mode idle": lambda b, t: dataclasses.replace(b, mode=ForwardMode.IDLE),
    "no requests": lambda b, t: dataclasses.replace(
        b,
        seq_lens_cpu=b.seq_lens_cpu[:0],
        req_pool_indices=b.req_pool_indices[:0],
        out_cache_loc=b.out_cache_loc[:0],
        positions=None,
    ),
    "not a ForwardBatch": lambda b, t: SimpleNamespace(**{f: getattr(b, f) for f in b.__slots__}),
}


def hostile_batches(setup: PlannerSetup, mode: ForwardMode, next_n: int, hostile: str):
    """``HOSTILE[hostile]`` applied to a random batch of every size up to ``BS``, with
    positions given and left out: what both lanes' tests compare with the general path."""
    for bs in range(1, BS + 1):
        for seed, positions in enumerate((True, False)):
            rng = random.Random(1000 * bs + seed)
            batch = setup.batch(rng, bs=bs, next_n=next_n, mode=mode, positions=positions)
            yield HOSTILE[hostile](batch, setup.table)
