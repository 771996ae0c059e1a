"""The sparse MLA kernel's split table as a plan field, declared once for both NSA plans.

The Triton sparse MLA decode kernel cuts each query row's top-k list into
splits (flash-decoding) so that a batch of one row still fills the SMs; how
many splits depends only on the batch size, and where each split starts only
on the rows' top-k lengths, which are the same in all 61 layers. So the count
is a derived dimension of the plan (``mla_splits``, a pure function of the
rows and the settings) and the table an op field computed once per batch, in
the graph when captured.

The option ``mla_fixed_splits`` (``N`` in ``1..MAX_SPLITS``) replaces that count by ``N``
whatever the rows: every row is then cut into ``N`` splits whose boundaries follow only
its own top-k length, the kernel's grid per row and its combine (or direct write, when
``N == 1``) are the same in every batch, and so a row's sparse MLA output is
bit-identical alone or inside any batch, at any position (the batch-invariant mode).
``0``, the default, keeps the wave model: batch-dependent and fastest.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from backends.common.triton_kernels import triton_available
from backends.nsa.sparse_mla_plan import (
    DEFAULT_CONFIG,
    MAX_SPLITS,
    sparse_mla_num_splits,
    split_plan_torch,
    split_plan_triton,
)
from planner.errors import SchemaError
from planner.ops import metadata_op
from planner.schema import Setting, scalar_field, tensor_field

I32 = torch.int32
KERNELS = ("auto", "triton", "torch")
"""``auto``: the Triton kernel on CUDA, the torch reference elsewhere."""

DEFAULTS: dict[str, Any] = {"mla_heads": 128, "mla_kernel": "auto", "mla_fixed_splits": 0}
"""DeepSeek-V3.2's 128 attention heads (the model passes its own); the kernel the plan
names; ``mla_fixed_splits`` 0: the split count from the wave model (batch-dependent), N in
``1..MAX_SPLITS``: N splits per row whatever the batch (batch-invariant)."""

sparse_mla_split_plan = metadata_op(
    "sparse_mla_split_plan",
    "The sparse MLA kernel's split table, flat [rows * (splits + 1)]: row r's split s reads "
    "top-k positions [t[r, s], t[r, s + 1]) of min(kv_len, topk), whole tiles of block_n.",
)


def _table(out: torch.Tensor, topk_lens: torch.Tensor) -> torch.Tensor:
    rows = topk_lens.shape[0]
    return out.view(rows, out.shape[0] // max(rows, 1))


@sparse_mla_split_plan.provider("torch")
def _split_torch(out: torch.Tensor, topk_lens: torch.Tensor, *, topk: int, block_n: int) -> None:
    split_plan_torch(_table(out, topk_lens), topk_lens, topk=topk, block_n=block_n)


@sparse_mla_split_plan.provider("triton", available=triton_available)
def _split_triton(out: torch.Tensor, topk_lens: torch.Tensor, *, topk: int, block_n: int) -> None:
    split_plan_triton(_table(out, topk_lens), topk_lens, topk=topk, block_n=block_n)


@lru_cache(maxsize=4096)
def _splits(rows: int, heads: int, topk: int, num_sms: int) -> int:
    return sparse_mla_num_splits(rows, heads=heads, topk=topk, num_sms=num_sms)


def split_dims(rows: int, dims: Mapping[str, int], settings: Mapping[str, Any]) -> dict[str, int]:
    """``mla_splits`` for ``rows`` query rows, and the flat table's length: the fixed
    count when ``mla_fixed_splits`` is set, else the wave model's for this many rows."""
    splits = settings.get("mla_fixed_splits", 0)
    if not splits:
        splits = _splits(max(rows, 1), settings["mla_heads"], settings["topk"], dims["sms"])
    return {"mla_splits": splits, "mla_split_cells": rows * (splits + 1)}


def split_table_field(rows: str) -> Any:
    """The plan field (its rows are ``rows``: the query rows of the plan)."""
    return tensor_field(
        I32,
        ("mla_split_cells",),
        op="sparse_mla_split_plan",
        inputs=("topk_lens",),
        params={"topk": Setting("topk"), "block_n": DEFAULT_CONFIG.block_n},
        pad=0,
        doc=f"split boundaries of each of the {rows} (viewed [{rows}, mla_splits + 1])",
    )


def splits_field() -> Any:
    return scalar_field("mla_splits", doc="splits per row of the sparse MLA kernel's grid")


def kernel_field() -> Any:
    return scalar_field("mla_kernel", doc="sparse MLA kernel: auto (Triton on CUDA), triton, torch")


def check_settings(settings: Mapping[str, Any]) -> None:
    heads = settings["mla_heads"]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise SchemaError("must be a positive int", field="nsa.mla_heads", actual=heads)
    if settings["mla_kernel"] not in KERNELS:
        raise SchemaError(
            "unknown sparse MLA kernel",
            field="nsa.mla_kernel",
            expected=KERNELS,
            actual=settings["mla_kernel"],
        )
    fixed = settings["mla_fixed_splits"]
    if isinstance(fixed, bool) or not isinstance(fixed, int) or not 0 <= fixed <= MAX_SPLITS:
        raise SchemaError(
            "splits per row of the sparse MLA kernel: 0 (the wave model, batch-dependent) or "
            f"a fixed count the combine takes (1..{MAX_SPLITS})",
            field="nsa.mla_fixed_splits",
            expected=f"0..{MAX_SPLITS}",
            actual=fixed,
        )
