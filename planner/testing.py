"""What a backend's tests need from the library, installed with it: batches and a provider check.

A plugin package tests its schema and ops the way the library tests its own: valid
``ForwardBatch`` es over a token table (:func:`token_table`, :func:`random_batch`), every
phase through ``graphs.GraphRunner`` on the CPU (``EmulatedGraph``; ``debug=True`` checks
each replay against a fresh eager plan), and each provider of each op against the torch
reference with outputs that start as garbage (:func:`check_provider`). See
``examples/plugin/tests`` and ``docs/backends.md``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planner.batch import ForwardBatch, ForwardMode
from planner.errors import ProviderError
from planner.ops import MetadataOp


def token_table(max_batch: int, max_context: int) -> torch.Tensor:
    """An engine's ``req_to_token`` for ``max_batch`` requests: row r holds request r's KV
    slots (``r * max_context + position``); row 0 is the null request (all slot 0), which
    padding rows and capture's dummy batches point at."""
    table = torch.zeros(max_batch + 1, max_context, dtype=torch.int32)
    for row in range(1, max_batch + 1):
        table[row] = row * max_context + torch.arange(max_context, dtype=torch.int32)
    return table


def random_batch(
    rng: random.Random, table: torch.Tensor, *, max_context: int, bs: int, next_n: int = 1
) -> ForwardBatch:
    """A valid decode batch (target verify with ``next_n`` > 1) of ``bs`` distinct requests
    over ``table``, with KV lengths in ``[next_n, max_context]``."""
    mode = ForwardMode.TARGET_VERIFY if next_n > 1 else ForwardMode.DECODE
    rows = torch.tensor(rng.sample(range(1, table.shape[0]), bs), dtype=torch.int64)
    lens = torch.tensor([rng.randint(next_n, max_context) for _ in range(bs)], dtype=torch.int32)
    cols = lens[:, None].long() - next_n + torch.arange(next_n)
    return ForwardBatch(
        seq_lens_cpu=lens,
        req_pool_indices=rows,
        req_to_token=table,
        out_cache_loc=table[rows[:, None], cols].reshape(-1),
        mode=mode,
        next_n=next_n,
    )


def check_provider(
    op: MetadataOp,
    provider: str,
    outputs: Sequence[tuple[Sequence[int], torch.dtype]],
    inputs: Sequence[torch.Tensor],
    params: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> None:
    """Raise ``ProviderError`` unless ``provider`` writes exactly what the torch reference
    writes into every output.

    ``outputs`` is each output's ``(shape, dtype)``, in the op's output order. Both runs'
    outputs start as different garbage, so an element a provider leaves unwritten differs:
    the check a plugin's tests run on each provider. Inputs are CPU tensors; the provider
    gets them on ``device``."""
    gen = torch.Generator().manual_seed(seed)

    def garbage() -> list[torch.Tensor]:
        return [
            torch.randint(-(2**31), 2**31 - 1, tuple(shape), generator=gen).to(dtype)
            for shape, dtype in outputs
        ]

    params = dict(params or {})
    want, got = garbage(), garbage()
    op.providers["torch"].fn(*want, *(x.clone() for x in inputs), **params)
    outs = [g.to(device) for g in got]
    op.providers[provider].fn(*outs, *(x.to(device) for x in inputs), **params)
    got = [o.cpu() for o in outs]
    names = op.outputs or (op.name,)
    for name, a, b in zip(names, want, got):
        differs = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
        if bool(differs.any()):
            raise ProviderError(
                f"{provider} differs from the torch reference in {int(differs.sum())} of "
                f"{a.numel()} elements (one left unwritten, or computed otherwise)",
                field=f"{op.name}.{name}",
                expected=a.flatten()[:8].tolist(),
                actual=b.flatten()[:8].tolist(),
            )
