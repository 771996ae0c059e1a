"""The ``example-mla`` plan: what a FlashMLA-style decode kernel reads in every layer.

A backend is this schema plus its ops. Each field says its dtype, its symbolic shape, the
value its padding rows hold, and where it comes from: a batch input (``source=``) or an op
over other fields (``op=``, ``inputs=``, ``params=``). Settings are the deployment's
values (``defaults`` here, overridden per planner with ``options={"example-mla": {...}}``);
``check_settings`` refuses bad ones at planner build; ``derived_dims`` adds a dimension of
this backend's own (the number of SM parts), carried into the plan as a scalar.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fp_example_mla.ops import META
from planner import PAD_DERIVED, Plan, SchemaError, Setting, Tensor, scalar_field, tensor_field

I32 = torch.int32
MLA = {
    "op": "mla_metadata",
    "inputs": ("cache_seqlens",),
    "params": {"block_n": Setting("block_n")},
}
"""One call of ``mla_metadata``: both of its fields name the same op, inputs and params."""


def sm_parts(dims: Mapping[str, int], settings: Mapping[str, Any]) -> int:
    """FlashMLA's ``num_sm_parts``: the SMs over the KV heads and the 64-row query tiles each
    KV head's query rows (``next_n * heads_q / heads_k``) take."""
    rows_per_k = dims["next_n"] * settings["num_heads_q"] // settings["num_heads_k"]
    return max(1, dims["sms"] // settings["num_heads_k"] // -(-rows_per_k // 64))


class MLADecodePlan(Plan, backend="example-mla"):
    """Decode and target-verify plans of a FlashMLA-style kernel (the default ``modes``)."""

    defaults: ClassVar[dict[str, Any]] = {
        "num_heads_q": 128,
        "num_heads_k": 1,
        "block_n": 64,
        "pad_len": 1,
    }

    cache_seqlens: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="seq_lens",
        pad=Setting("pad_len"),
        doc="KV length of each request; a padding request reads pad_len tokens of the null slot",
    )
    req_pool_indices: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="req_pool_indices",
        pad=0,
        doc="request-pool row of each request; padding requests read row 0, the null request",
    )
    token_slots: Tensor = tensor_field(
        I32,
        ("reqs", "max_len"),
        op="gather_token_slots",
        inputs=("req_to_token", "req_pool_indices", "cache_seqlens"),
        pad=0,
        doc="KV slot of each position (a shared op); 0 past the length",
    )
    block_table: Tensor = tensor_field(
        I32,
        ("reqs", "pages"),
        op="page_table",
        inputs=("token_slots",),
        params={"page_size": Setting("page_size")},
        pad=0,
        doc="KV page of each page position (a shared op); 0, the null page, past the end",
    )
    tile_scheduler_metadata: Tensor = tensor_field(
        I32,
        ("sm_parts", META),
        output="tile_scheduler_metadata",
        pad=PAD_DERIVED,
        doc="what each SM part reads: begin req/pos, end req/pos, first split",
        **MLA,
    )
    num_splits: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        output="num_splits",
        pad=PAD_DERIVED,
        doc="offsets of each request's splits (the combine kernel reads them)",
        **MLA,
    )
    sm_parts: int = scalar_field("sm_parts", doc="SM parts the kernel's grid runs")
    block_n: int = scalar_field("block_n", doc="KV tokens per block")

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Refuse, at planner build, what the kernel cannot run, naming the option."""
        for name in ("num_heads_q", "num_heads_k", "block_n", "pad_len"):
            value = settings[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SchemaError(
                    "must be a positive int",
                    field=f"example-mla.{name}",
                    expected=">= 1",
                    actual=value,
                )
        if settings["num_heads_q"] % settings["num_heads_k"]:
            raise SchemaError(
                "query heads must be a multiple of the KV heads",
                field="example-mla.num_heads_q",
                expected=f"a multiple of {settings['num_heads_k']}",
                actual=settings["num_heads_q"],
            )

    @classmethod
    def derived_dims(cls, dims: Mapping[str, int], settings: Mapping[str, Any]) -> dict[str, int]:
        """``sm_parts``: fixed per deployment here, so static buffers are that size."""
        return {"sm_parts": sm_parts(dims, settings)}
