"""The limits a planner is built for: they size every static buffer."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.errors import ConfigError


class Limits(BaseModel):
    """Deployment bounds. Batches beyond them are rejected at the door.

    ``next_n`` is the number of tokens per request in target-verify and draft
    extend (speculative decoding); decode always has one. ``draft_steps`` is
    the number of one-token steps a draft-decode batch plans at once. ``max_tokens`` bounds the
    query tokens of an extend or mixed batch (the chunked-prefill budget); by
    default one whole longest request fits. ``num_sms`` sizes the deep_gemm
    schedule (132 on an H200). ``kv_slots``, when given, lets the planner
    range-check ``out_cache_loc`` and the token table's entries.
    ``ragged_kv_tokens`` is the stated bound of a captured extend or mixed batch's total KV
    (the sum of its KV lengths, one per padding request included): the flat gathered KV of a
    ragged capture is that long, and a ragged step past it cannot replay (it runs eagerly).
    Unset, it is ``max_batch * max_context`` (:attr:`kv_token_capacity`), and ragged static
    buffers count against ``max_static_bytes`` only once a ragged capture is made; set, they
    count from the start.
    ``max_static_bytes`` bounds the static buffers a planner will allocate for
    its captured plans: past it, the planner refuses to build (naming the field
    that takes the most) instead of trying to allocate.

    Values are checked strictly (``max_batch="8"`` or ``8.0`` is refused, not
    converted), and a CUDA device must exist here: a mistake is refused when the
    limits are made, not at the first capture.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    max_batch: int = Field(ge=1, le=65536, description="largest number of requests in one batch")
    max_context: int = Field(ge=1, le=1 << 24, description="longest KV length of one request")
    page_size: int = Field(default=64, ge=1, le=4096, description="tokens per KV page")
    next_n: int = Field(default=1, ge=1, le=16, description="tokens per request in target-verify")
    draft_steps: int = Field(
        default=0, ge=0, le=15, description="steps of a draft-decode batch (0: none planned)"
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=1 << 24, description="query tokens of one extend or mixed batch"
    )
    ragged_kv_tokens: int | None = Field(
        default=None, ge=1, le=(1 << 31) - 1, description="total KV of a captured ragged batch"
    )
    num_sms: int = Field(
        default=132, ge=1, le=4096, description="SMs the schedule splits work over"
    )
    kv_slots: int | None = Field(default=None, ge=1, description="KV cache slots, for range checks")
    device: str = Field(default="cpu", description="where plans live: 'cpu', 'cuda', 'cuda:1'")
    max_static_bytes: int = Field(
        default=4 << 30, ge=0, description="most bytes of static plan buffers (default 4 GiB)"
    )

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            first = exc.errors()[0]
            value = first.get("input")
            raise ConfigError(
                f"invalid limits: {first['msg']}",
                field=".".join(str(p) for p in first["loc"]) or "limits",
                actual=repr(value) if isinstance(value, (int, float, str)) else None,
            ) from None

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        try:
            device = torch.device(value)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"not a torch device: {value!r}") from exc
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{value!r} asked for, but CUDA is not available here")
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise ValueError(f"{value!r} asked for, but this machine has {count} CUDA devices")
        return value

    @property
    def torch_device(self) -> torch.device:
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            if not torch.cuda.is_available():
                raise ConfigError(
                    "CUDA device asked for, but CUDA is not available here",
                    field="device",
                    actual=self.device,
                )
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    @property
    def extend_tokens(self) -> int:
        """Most query tokens an extend or mixed batch may hold (uniform batches are bounded
        by ``max_batch * next_n`` already)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return max(self.max_batch * self.next_n, self.max_context)

    @property
    def kv_token_capacity(self) -> int:
        """The total KV a captured ragged batch may hold (``ragged_kv_tokens``, by default
        every request at ``max_context``)."""
        if self.ragged_kv_tokens is not None:
            return self.ragged_kv_tokens
        return self.max_batch * self.max_context

    @property
    def max_pages(self) -> int:
        """Pages of the longest request."""
        return -(-self.max_context // self.page_size)
