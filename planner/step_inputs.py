"""A step's raw inputs, written once by the engine into the planner's staging memory.

The engine (its scheduler) writes each step's inputs straight into a slot the planner owns:
typed int32 views of one host buffer, one per input (:data:`planner.batch.SOURCES`), and a
header with the step's real request and token counts. Nothing is copied, filled or checked
on the host after that: the slot goes to the device in one transfer, and the device pads,
derives and checks it (``planner.device_checks``) before any op reads it.
:class:`~planner.batch.ForwardBatch` stays the convenient form; :func:`write_batch` writes it
into the same views, so both ways reach the planner by one path.

Layout of a region (one batch; a draft decode's ``k`` steps have ``k`` regions side by side):
the header (``HEADER`` words), then each input at its capacity, per-request inputs
(``max_reqs`` each) before per-token ones (``max_tokens`` each), in ``SOURCES`` order. The
layout is fixed per mode, so a slot is written before the graph bucket is chosen, and a bucket
reads the leading rows of each input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from planner.batch import SOURCES, ForwardBatch, ForwardMode
from planner.errors import BatchError, ReplayError

HEADER = ("reqs", "tokens", "positions_given", "reserved")
"""The words before the inputs: real requests, real query tokens, whether the engine wrote
positions (else the device derives them from the lengths)."""
BATCH_FIELD = {"seq_lens": "seq_lens_cpu", "extend_lens": "extend_lens_cpu"}
"""The ForwardBatch attribute an input is named by in errors, where it differs."""


@dataclass(frozen=True)
class InputLayout:
    """Where each input of one region lives: offsets in int32 words from the region's start."""

    max_reqs: int
    max_tokens: int

    @property
    def offsets(self) -> dict[str, int]:
        out, at = {}, len(HEADER)
        for source, per_token in SOURCES.items():
            out[source] = at
            at += self.max_tokens if per_token else self.max_reqs
        return out

    @property
    def size(self) -> int:
        """int32 words of one region."""
        per_token = sum(SOURCES.values())
        return (
            len(HEADER) + per_token * self.max_tokens + (len(SOURCES) - per_token) * self.max_reqs
        )

    def capacity(self, source: str) -> int:
        return self.max_tokens if SOURCES[source] else self.max_reqs

    def locate(self, index: int) -> tuple[str, int]:
        """``(source, row)`` of word ``index`` of a region (what a device error names)."""
        for source, start in self.offsets.items():
            if start <= index < start + self.capacity(source):
                return source, index - start
        return "header", index


class StepInputs:
    """One region of a staging slot, as typed views: the engine writes rows ``[0, n)`` of
    each input and then :meth:`set_counts`. Rows past the counts are never read as real
    (the device writes the pads there)."""

    def __init__(
        self, buffer: torch.Tensor, layout: InputLayout, mode: ForwardMode = ForwardMode.DECODE
    ) -> None:
        if buffer.dtype != torch.int32 or buffer.dim() != 1 or buffer.numel() < layout.size:
            raise BatchError(
                "a staging region is int32, 1-D and holds its layout",
                field="buffer",
                expected=f"int32 [{layout.size}]",
                actual=f"{buffer.dtype} {tuple(buffer.shape)}",
            )
        self.buffer, self.layout, self.mode = buffer, layout, mode
        self.sent: tuple[int, int] | None = None
        """(slot, step) once the stager sent this slot with that step, until it hands the
        slot out again: a write then would race the transfer (:meth:`set_counts` refuses)."""
        words = buffer.numpy()
        self.header = words[: len(HEADER)]
        self.addresses: dict[str, int] = {}
        """Where each input's view starts: a batch's tensors are the slot's if they start here."""
        for source, start in layout.offsets.items():
            setattr(self, source, words[start : start + layout.capacity(source)])
            self.addresses[source] = buffer.data_ptr() + 4 * start

    seq_lens: np.ndarray
    """KV length of each request, this step's tokens included."""
    extend_lens: np.ndarray
    """Query tokens each request adds this step."""
    req_pool_indices: np.ndarray
    """Each request's row of the token table."""
    out_cache_loc: np.ndarray
    """The KV slot each query token writes, request-major."""
    positions: np.ndarray
    """Each query token's position (optional: see :meth:`set_counts`)."""

    def set_counts(self, reqs: int, tokens: int, *, positions_given: bool = True) -> None:
        """The step's real requests and query tokens; ``positions_given`` False lets the
        device derive the positions from the lengths (the last ``extend_lens[b]`` of each
        request's ``seq_lens[b]``). Refused on a slot already sent: a loop that runs ahead
        must take each step's slot anew (``Planner.step_inputs``), never keep an old one."""
        if self.sent is not None:
            slot, step = self.sent
            raise ReplayError(
                f"{self.mode.value} staging slot {slot} was written after step {step} sent "
                "it: its transfer may not have run yet. Take each step's slot from "
                "Planner.step_inputs after the last replay, never an earlier step's",
                field="step_inputs",
                expected="the slot handed out for this step",
                actual=f"slot {slot}, sent with step {step}",
            )
        for name, value, cap in (
            ("reqs", reqs, self.layout.max_reqs),
            ("tokens", tokens, self.layout.max_tokens),
        ):
            if not 0 <= value <= cap:
                raise BatchError(
                    f"more {name} than the staging slot holds",
                    field=name,
                    expected=f"[0, {cap}]",
                    actual=value,
                )
        self.header[0], self.header[1], self.header[2] = reqs, tokens, int(positions_given)

    def fits(self, reqs: int, tokens: int) -> bool:
        """Whether a step of ``reqs`` requests and ``tokens`` tokens fits this slot."""
        return reqs <= self.layout.max_reqs and tokens <= self.layout.max_tokens

    def write(
        self,
        seq_lens: Sequence[int],
        extend_lens: Sequence[int] | int,
        req_pool_indices: Sequence[int],
        out_cache_loc: Sequence[int],
        positions: Sequence[int] | None = None,
    ) -> None:
        """A whole step from the engine's own lists (or arrays), counts included: each
        request's KV length, new tokens (one count for all in a uniform step) and row, each
        token's KV slot and, where given, position."""
        n, t = len(seq_lens), len(out_cache_loc)
        self.seq_lens[:n] = seq_lens
        self.extend_lens[:n] = extend_lens
        self.req_pool_indices[:n] = req_pool_indices
        self.out_cache_loc[:t] = out_cache_loc
        if positions is not None:
            self.positions[:t] = positions
        self.set_counts(n, t, positions_given=positions is not None)

    def batch(self, req_to_token: torch.Tensor, next_n: int = 1) -> ForwardBatch:
        """The step written here as a :class:`ForwardBatch` whose tensors are views of this
        slot (no copy): what the engine hands the graph runner, and what a replay
        recognises as already staged. Extend lengths are given where the mode's requests
        add different counts (ragged, draft extend)."""
        reqs, tokens = self.reqs, self.tokens
        mode = self.mode
        ragged = mode.ragged or mode.padded_rows
        return ForwardBatch(
            seq_lens_cpu=torch.from_numpy(self.seq_lens[:reqs]),
            req_pool_indices=torch.from_numpy(self.req_pool_indices[:reqs]),
            req_to_token=req_to_token,
            out_cache_loc=torch.from_numpy(self.out_cache_loc[:tokens]),
            positions=torch.from_numpy(self.positions[:tokens]) if self.header[2] else None,
            mode=mode,
            next_n=next_n,
            extend_lens_cpu=torch.from_numpy(self.extend_lens[:reqs]) if ragged else None,
            inputs=self,
        )

    @property
    def reqs(self) -> int:
        return int(self.header[0])

    @property
    def tokens(self) -> int:
        return int(self.header[1])


def write_batch(
    inputs: StepInputs, batch: ForwardBatch, tokens: int
) -> list[tuple[str, torch.Tensor]]:
    """Write ``batch`` (checked at the door: ``tokens`` query tokens) into ``inputs``; the
    device-resident inputs it holds, left for a device-to-device copy after the transfer
    (reading them here would wait for the GPU). Extend lengths a uniform batch leaves out
    are written as the count they are; positions it leaves out the device derives."""
    reqs = batch.bs
    on_device = []
    for source in SOURCES:
        if source == "extend_lens":
            value = batch.extend_lens_cpu
            if value is None:
                inputs.extend_lens[:reqs] = batch.next_n
                continue
        elif source == "seq_lens":
            value = batch.seq_lens_cpu
        else:
            value = getattr(batch, source)
            if value is None:  # positions left out
                continue
        if value.is_cuda:
            on_device.append((source, value))
            continue
        values = value.numpy()
        if values.dtype != np.int32 and values.size:
            _fits_int32(source, values)
        getattr(inputs, source)[: values.shape[0]] = values
    inputs.set_counts(reqs, tokens, positions_given=batch.positions is not None)
    return on_device


def _fits_int32(source: str, values: np.ndarray) -> None:
    """int64 inputs are staged as int32: a value past int32 would wrap into a valid-looking
    one, so it is refused here (the device checks every other range)."""
    info = np.iinfo(np.int32)
    low, high = int(values.min()), int(values.max())
    if low < info.min or high > info.max:
        raise BatchError(
            "value out of range (staged as int32)",
            field=BATCH_FIELD.get(source, source),
            expected=f"[{info.min}, {info.max}]",
            actual=low if low < info.min else high,
        )


def copy_on_device(
    region: torch.Tensor, layout: InputLayout, pending: Mapping[str, torch.Tensor]
) -> None:
    """The device-resident inputs :func:`write_batch` left, into the device ``region``; an
    int64 value past int32 is written as -1, so the device check refuses it."""
    offsets = layout.offsets
    for source, tensor in pending.items():
        start = offsets[source]
        if tensor.dtype != torch.int32:  # past int32 it would wrap into a valid-looking value:
            info = torch.iinfo(torch.int32)  # -1 instead, which every range refuses
            tensor = torch.where((tensor < info.min) | (tensor > info.max), -1, tensor)
        region[start : start + tensor.shape[0]].copy_(tensor)
