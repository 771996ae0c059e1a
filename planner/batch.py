"""The forward batch a scheduler hands the planner, and its door checks.

A plain frozen dataclass rather than a pydantic model: one is built every
step on the hot path, and the planner validates it itself with messages that
name the field and the limit. Every check here reads host memory only, so it
costs microseconds and never waits for the GPU; checks that would need a
device read run in eager ``plan()`` and in debug mode only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from planner.errors import BatchError


class ForwardMode(str, enum.Enum):
    """What the forward computes: one token per request, or ``next_n`` to verify."""

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"


BATCH_TABLES = frozenset({"req_to_token"})
"""Device tables the engine owns; ops read them in place and graphs bind their address."""

HOST_INPUTS = frozenset({"seq_lens_cpu"})
"""Host tensors of the batch a host op (``graph_safe=False``) may read, e.g. FlashInfer's plan."""

SOURCES = ("seq_lens", "req_pool_indices", "positions", "out_cache_loc")
"""Per-request or per-token batch inputs a schema can stage with ``source=``."""


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's batch.

    ``seq_lens_cpu`` is the KV length of each request *including* this step's
    new tokens (``next_n`` of them in target-verify). ``req_pool_indices``,
    ``positions`` and ``out_cache_loc`` may live on the host (staged with the
    lengths in one copy) or already on the device. ``seq_lens`` is the optional
    device copy an engine may already hold.
    """

    seq_lens_cpu: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    mode: ForwardMode = ForwardMode.DECODE
    next_n: int = 1

    @property
    def bs(self) -> int:
        """Requests in the batch."""
        shape = self.seq_lens_cpu.shape
        return shape[0] if len(shape) == 1 else -1

    @property
    def num_tokens(self) -> int:
        """Query tokens in the batch: ``bs * next_n``."""
        return self.bs * self.next_n

    def source(self, name: str) -> torch.Tensor:
        """The batch input a schema's ``source=`` names (positions derived if absent)."""
        if name == "seq_lens":
            return self.seq_lens_cpu
        if name == "positions" and self.positions is None:
            return derive_positions(self.seq_lens_cpu, self.next_n)
        return getattr(self, name)


def derive_positions(seq_lens_cpu: torch.Tensor, next_n: int) -> torch.Tensor:
    """Positions of this step's tokens when the engine gives none: the last ``next_n`` slots."""
    offsets = torch.arange(next_n - 1, -1, -1, dtype=torch.int32)
    return (seq_lens_cpu.to(torch.int32)[:, None] - 1 - offsets[None, :]).reshape(-1)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensor(
    name: str,
    tensor: object,
    *,
    dtypes: tuple[torch.dtype, ...],
    rank: int,
    devices: tuple[torch.device, ...],
    length: int | None = None,
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise BatchError(
            "not a tensor", field=name, expected="torch.Tensor", actual=type(tensor).__name__
        )
    if tensor.dtype not in dtypes:
        raise BatchError(
            "wrong dtype", field=name, expected=" or ".join(map(str, dtypes)), actual=tensor.dtype
        )
    if tensor.dim() != rank:
        raise BatchError("wrong rank", field=name, expected=rank, actual=tensor.dim())
    if tensor.device not in devices:
        raise BatchError(
            "wrong device",
            field=name,
            expected=" or ".join(map(str, devices)),
            actual=tensor.device,
        )
    if not tensor.is_contiguous():
        raise BatchError(
            "not contiguous", field=name, expected="contiguous", actual=tuple(tensor.stride())
        )
    if length is not None and tensor.shape[0] != length:
        raise BatchError("wrong length", field=name, expected=length, actual=tensor.shape[0])
    return tensor


def _check_host_range(name: str, tensor: torch.Tensor, lo: int, hi: int) -> None:
    """Values must lie in [lo, hi]; checked only for host tensors (no device sync)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    values = tensor.numpy()  # host reductions through numpy: microseconds, not a torch dispatch
    low, high = int(values.min()), int(values.max())
    if low < lo or high > hi:
        bad = low if low < lo else high
        raise BatchError("value out of range", field=name, expected=f"[{lo}, {hi}]", actual=bad)


def validate_batch(
    batch: ForwardBatch,
    *,
    device: torch.device,
    max_batch: int,
    max_context: int,
    next_n: int,
    kv_slots: int | None,
    device_reads: bool,
    host_ranges: bool = True,
) -> None:
    """Reject a batch that breaks a limit, naming the field, before any kernel runs.

    ``device_reads`` also range-checks inputs that live on the device, which
    costs a synchronisation: eager ``plan()`` and debug mode pay it, replay not.
    ``host_ranges=False`` leaves the value ranges of host inputs to the caller
    (the planner checks them in one vectorised pass over its staging buffer).
    """
    if not isinstance(batch, ForwardBatch):
        raise BatchError("not a ForwardBatch", field="batch", actual=type(batch).__name__)
    try:
        mode = ForwardMode(batch.mode)
    except ValueError:
        raise BatchError(
            "unknown mode", field="mode", expected=[m.value for m in ForwardMode], actual=batch.mode
        ) from None
    want_n = 1 if mode is ForwardMode.DECODE else next_n
    if batch.next_n != want_n:
        raise BatchError(
            f"next_n does not match the planner for mode {mode.value}",
            field="next_n",
            expected=want_n,
            actual=batch.next_n,
        )
    cpu = torch.device("cpu")
    both = (cpu, device) if device != cpu else (cpu,)
    seq = _check_tensor(
        "seq_lens_cpu", batch.seq_lens_cpu, dtypes=(torch.int32,), rank=1, devices=(cpu,)
    )
    bs = seq.shape[0]
    if bs == 0:
        raise BatchError("empty batch", field="seq_lens_cpu", expected=">= 1 request", actual=0)
    if bs > max_batch:
        raise BatchError(
            "batch larger than max_batch",
            field="seq_lens_cpu",
            expected=f"<= {max_batch}",
            actual=bs,
        )
    table = _check_tensor(
        "req_to_token", batch.req_to_token, dtypes=(torch.int32,), rank=2, devices=(device,)
    )
    if host_ranges:
        _check_host_range("seq_lens_cpu", seq, want_n, max_context)
        check_table_width(table, int(seq.numpy().max()))
    pool = _check_tensor(
        "req_pool_indices",
        batch.req_pool_indices,
        dtypes=_INDEX_DTYPES,
        rank=1,
        devices=both,
        length=bs,
    )
    tokens = bs * want_n
    loc = _check_tensor(
        "out_cache_loc",
        batch.out_cache_loc,
        dtypes=_INDEX_DTYPES,
        rank=1,
        devices=both,
        length=tokens,
    )
    checks = [("req_pool_indices", pool, 0, table.shape[0] - 1)]
    if kv_slots is not None:
        checks.append(("out_cache_loc", loc, 0, kv_slots - 1))
    if batch.positions is not None:
        pos = _check_tensor(
            "positions", batch.positions, dtypes=_INDEX_DTYPES, rank=1, devices=both, length=tokens
        )
        checks.append(("positions", pos, 0, max_context - 1))
    if batch.seq_lens is not None:
        dev_seq = _check_tensor(
            "seq_lens", batch.seq_lens, dtypes=(torch.int32,), rank=1, devices=(device,), length=bs
        )
        if device_reads and not torch.equal(dev_seq.cpu(), seq):
            raise BatchError("device seq_lens differ from seq_lens_cpu", field="seq_lens")
    for name, tensor, lo, hi in checks:
        if tensor.device.type != "cpu":
            if not device_reads:
                continue
            tensor = tensor.cpu()
        elif not host_ranges:
            continue
        _check_host_range(name, tensor, lo, hi)


def check_table_width(table: torch.Tensor, longest: int) -> None:
    """A token table one column short would make the gather read past a row."""
    if table.shape[1] < longest:
        raise BatchError(
            "token table narrower than the longest request",
            field="req_to_token",
            expected=f">= {longest} columns",
            actual=table.shape[1],
        )
