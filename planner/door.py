"""The door: a batch's structure checked before anything is staged or launched.

Types, ranks, devices, lengths and the mode are checked here, on the host,
in microseconds. Value ranges are checked once, vectorised, where the inputs
are staged (``planner.staging``); a check that needs a device read (a
device-resident input, the device copy of the lengths) runs in eager
``plan()`` and in debug mode only, never on the replay hot path.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from planner.batch import RAGGED_MODES, ForwardBatch, ForwardMode
from planner.errors import BatchError

_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_ONLY = (torch.int32,)
_CPU = torch.device("cpu")


class _OnHost(tuple):
    """Devices that are all the host (``cpu``, or ``cpu:0``): checked as ``tensor.is_cpu``,
    which is what any host device accepts, and cheaper than reading ``tensor.device``;
    ``device.type`` alone costs more than the rest of the check."""


_HOST = _OnHost((_CPU,))
_SETS: dict[torch.device, tuple[tuple, tuple]] = {}
_IDLE, _DRAFT_DECODE = ForwardMode.IDLE, ForwardMode.DRAFT_DECODE
"""Module constants: looking an enum member up on its class costs 0.1 us a time."""
_UNIFORM_IMPLIED = frozenset(m for m in ForwardMode if not m.ragged and not m.padded_rows)
"""Modes whose batches may leave ``extend_lens_cpu`` out: ``bs * next_n`` tokens."""


def _check_tensor(
    name: str,
    tensor: object,
    dtypes: tuple[torch.dtype, ...],
    rank: int,
    devices: tuple[torch.device, ...],
    length: int | None = None,
) -> torch.Tensor:
    # The hot path: one expression that holds for every good input (replay runs this for
    # five tensors per step, positionally: keywords cost a call more); the checks below
    # run only to name what is wrong.
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype in dtypes
        and tensor.dim() == rank
        and (tensor.is_cpu if devices.__class__ is _OnHost else tensor.device in devices)
        and tensor.is_contiguous()
        and (length is None or tensor.shape[0] == length)
    ):
        return tensor
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


def _device_sets(device: torch.device) -> tuple[tuple, tuple]:
    """The devices a device-resident input may be on (the planner's), and an index input
    (the host or the planner's); made once per device (a comparison and a ``.type`` read)."""
    sets = _SETS.get(device)
    if sets is None:
        both = (_CPU, device) if device != _CPU else (_CPU,)
        sets = _SETS[device] = (_host_form((device,)), _host_form(both))
    return sets


def _host_form(devices: tuple[torch.device, ...]) -> tuple[torch.device, ...]:
    """``devices`` as an ``_OnHost`` tuple when it is one host device (the fast check)."""
    if len(devices) == 1 and devices[0].type == "cpu":
        return _OnHost(devices)
    return devices


def validate_batch(
    batch: ForwardBatch,
    *,
    device: torch.device,
    max_batch: int,
    max_tokens: int,
    next_n: Mapping[ForwardMode, int],
    device_reads: bool,
) -> ForwardMode:
    """Reject a malformed batch, naming the field, before anything is staged; its mode.

    Structure only (types, ranks, devices, lengths, counts): value ranges are
    checked where the inputs are staged. ``next_n`` is each mode's tokens per
    request (absent: 1). ``device_reads`` also compares the engine's device
    copies of the lengths with the host ones, which costs a synchronisation:
    eager ``plan()`` and debug mode pay it, replay not.
    """
    if not isinstance(batch, ForwardBatch):
        raise BatchError("not a ForwardBatch", field="batch", actual=type(batch).__name__)
    mode = batch.mode
    if mode.__class__ is not ForwardMode:  # a plain string: the enum call, and its refusal
        try:
            mode = ForwardMode(mode)
        except ValueError:
            raise BatchError(
                "unknown mode",
                field="mode",
                expected=[m.value for m in ForwardMode],
                actual=batch.mode,
            ) from None
    want_n = next_n.get(mode, 1)
    if batch.next_n != want_n:
        raise BatchError(
            f"next_n does not match the planner for mode {mode.value}",
            field="next_n",
            expected=want_n,
            actual=batch.next_n,
        )
    on_device, both = _device_sets(device)
    seq = _check_tensor("seq_lens_cpu", batch.seq_lens_cpu, _INT32_ONLY, 1, _HOST)
    bs = seq.shape[0]
    if bs == 0 or mode is _IDLE:
        _check_idle(mode, bs)
    if bs > max_batch:
        raise BatchError(
            "batch larger than max_batch",
            field="seq_lens_cpu",
            expected=f"<= {max_batch}",
            actual=bs,
        )
    lens = batch.extend_lens_cpu
    if lens is None and mode in _UNIFORM_IMPLIED:  # decode, verify: bs * next_n tokens
        tokens = bs * batch.next_n
    else:
        tokens = _check_extend_lens(batch, mode, bs, max_tokens)
    if mode is _DRAFT_DECODE and bs and int(seq.numpy().min()) < batch.next_n:
        raise BatchError(
            "a draft-decode batch's KV lengths include its k draft tokens (its first step's "
            "length is seq_lens_cpu - k + 1 >= 1)",
            field="seq_lens_cpu",
            expected=f">= {batch.next_n}",
            actual=int(seq.numpy().min()),
        )
    _check_tensor("req_to_token", batch.req_to_token, _INT32_ONLY, 2, on_device)
    _check_tensor("req_pool_indices", batch.req_pool_indices, _INDEX_DTYPES, 1, both, bs)
    _check_tensor("out_cache_loc", batch.out_cache_loc, _INDEX_DTYPES, 1, both, tokens)
    if batch.positions is not None:
        _check_tensor("positions", batch.positions, _INDEX_DTYPES, 1, both, tokens)
    if (
        lens is not None
        and bs
        and mode not in RAGGED_MODES
        and int(lens.numpy().max()) > batch.next_n
    ):
        # a uniform batch has next_n rows per request: more tokens would not fit them
        raise BatchError(
            f"a {mode.value} request adds at most next_n tokens",
            field="extend_lens_cpu",
            expected=f"<= {batch.next_n}",
            actual=int(lens.numpy().max()),
        )
    if batch.seq_lens is not None or batch.extend_lens is not None:
        _check_device_lens(batch, seq, bs, on_device, device_reads)
    return mode


def _check_idle(mode: ForwardMode, bs: int) -> None:
    """An idle batch has no request, and only an idle batch has none."""
    if mode is _IDLE and bs:
        raise BatchError(
            "an idle batch has no requests", field="seq_lens_cpu", expected=0, actual=bs
        )
    if bs == 0 and mode is not _IDLE:
        raise BatchError(
            "empty batch (a rank with no work sends mode idle)",
            field="seq_lens_cpu",
            expected=">= 1 request",
            actual=0,
        )


def _check_device_lens(
    batch: ForwardBatch,
    seq: torch.Tensor,
    bs: int,
    on_device: tuple[torch.device, ...],
    device_reads: bool,
) -> None:
    """The engine's device copies of the lengths: each with its host copy, on the planner's
    device, and (``device_reads`` only: a sync) equal to it."""
    for name, host in (("seq_lens", seq), ("extend_lens", batch.extend_lens_cpu)):
        dev = getattr(batch, name)
        if dev is None:
            continue
        if host is None:
            raise BatchError(f"device {name} without its host copy", field=f"{name}_cpu")
        _check_tensor(name, dev, _INT32_ONLY, 1, on_device, bs)
        if device_reads and not torch.equal(dev.cpu(), host):
            raise BatchError(f"device {name} differ from {name}_cpu", field=name)


def _check_extend_lens(batch: ForwardBatch, mode: ForwardMode, bs: int, max_tokens: int) -> int:
    """The query tokens of the batch: extend lengths are required for ragged modes only."""
    lens = batch.extend_lens_cpu
    if lens is None:
        if mode.ragged or mode.padded_rows:
            raise BatchError(
                f"a {mode.value} batch says how many tokens each request adds",
                field="extend_lens_cpu",
                expected="int32 [bs]",
                actual=None,
            )
        tokens = bs * batch.next_n
    elif mode.stepped:
        raise BatchError(
            "a draft-decode batch adds exactly k tokens per request: leave extend_lens_cpu out",
            field="extend_lens_cpu",
            expected="None",
            actual="a tensor",
        )
    else:
        _check_tensor("extend_lens_cpu", lens, _INT32_ONLY, 1, _HOST, bs)
        values = lens.numpy()
        if bs and int(values.min()) < 1:  # the token layout itself is undefined: not a range
            raise BatchError(
                "every request adds at least one token",
                field="extend_lens_cpu",
                expected=">= 1",
                actual=int(values.min()),
            )
        tokens = int(values.sum()) if bs else 0
    if mode.ragged and tokens > max_tokens:
        raise BatchError(
            "more query tokens than max_tokens",
            field="extend_lens_cpu",
            expected=f"<= {max_tokens} tokens",
            actual=tokens,
        )
    return tokens


def check_size(name: str, value: object, lo: int, hi: int, what: str) -> int:
    """A request count argument (``bs``, ``pad_to``): an integer in ``[lo, hi]`` (numpy's
    included), as a Python int; a float or a bool is refused."""
    if value.__class__ is int and lo <= value <= hi:  # the usual case (a bool's class is bool)
        return value
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or not lo <= size <= hi:
        shown = repr(value) if isinstance(value, str) else value
        raise BatchError(what, field=name, expected=f"an int in [{lo}, {hi}]", actual=shown)
    return size


def check_replay_size(bs: object, real: int, max_batch: int) -> int:
    """``replay(batch, bs)``: a captured size in range (the batch's own, at least one, by
    default) that holds the batch's ``real`` requests; the size as a Python int."""
    bs = check_size(
        "bs", max(real, 1) if bs is None else bs, 1, max_batch, "replay size out of range"
    )
    if real > bs:
        raise BatchError(
            "batch larger than the replayed size", field="bs", expected=f"<= {bs}", actual=real
        )
    return bs


def check_table_width(table: torch.Tensor, longest: int) -> None:
    """A token table one column short would make the gather read past a row."""
    if table.shape[1] < longest:
        raise BatchError(
            "token table narrower than the longest request",
            field="req_to_token",
            expected=f">= {longest} columns",
            actual=table.shape[1],
        )


def check_pad_to(pad_to: object, bs: int, max_batch: int, mode: ForwardMode) -> int | None:
    """``plan(batch, pad_to=n)``: a captured size that holds the batch, for a uniform mode;
    the size as a Python int."""
    if pad_to is None:
        return None
    pad_to = check_size("pad_to", pad_to, bs, max_batch, "pad_to out of range")
    if mode.ragged:
        raise BatchError(
            "ragged batches are planned eagerly, never padded to a captured size",
            field="pad_to",
            actual=pad_to,
        )
    return pad_to


def check_capture(mode: ForwardMode, bs: object, max_batch: int) -> int:
    """``capture(bs, mode)``: a uniform mode (idle replays decode's graphs) and a size in range;
    the size as a Python int."""
    if mode.ragged or mode is ForwardMode.IDLE:
        raise BatchError(
            "only uniform modes are captured (idle batches replay the decode graphs)",
            field="mode",
            expected=[m.value for m in ForwardMode if not m.ragged and m is not ForwardMode.IDLE],
            actual=mode.value,
        )
    return check_size("bs", bs, 1, max_batch, "capture size out of range")
