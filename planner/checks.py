"""Checks of a batch: its structure at the door, its values where they are staged.

The door (:func:`validate_batch`) checks types, ranks, devices, lengths and the mode on the
host, in microseconds, before anything is staged or launched. Value ranges are checked
once, vectorised, where the inputs are staged (``planner.staging``, with
:class:`ElementBounds`); a check that needs a device read (a device-resident input, the
device copy of the lengths, the token table on a GPU) runs in eager ``plan()`` and in
debug mode only, never on the replay path.

Each input can be in range and the batch still be wrong: two tokens writing one KV slot (a
race on the GPU), one request twice in a batch, positions that disagree with the lengths
(rope at the wrong position), a token table entry past the KV cache. The first three are
checked on the staged host values in every phase; the token table is engine memory on the
device: its entries are read in eager ``plan()`` when the table is on the host (free), and
on a GPU at capture and in debug mode only (a device read costs about 0.5 ms a plan and a
stall behind whatever the GPU has queued). The null request (row 0) and the null slot 0
are this repository's padding convention: they may repeat.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping

import numpy as np
import torch

from planner.batch import RAGGED_MODES, UNIFORM_MODES, ForwardBatch, ForwardMode
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
_IDLE, _DECODE, _DRAFT_DECODE = ForwardMode.IDLE, ForwardMode.DECODE, ForwardMode.DRAFT_DECODE
"""Module constants: an enum member looked up on its class costs a dictionary look-up a time."""
_UNIFORM_IMPLIED = frozenset(m for m in ForwardMode if not m.ragged and not m.padded_rows)
"""Modes whose batches may leave ``extend_lens_cpu`` out: ``bs * next_n`` tokens."""
_SHAPES = [m for m in ForwardMode if m in UNIFORM_MODES and m is not _IDLE]
"""What an idle batch may be shaped as (``idle_as``): the uniform modes, in enum order."""


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
    planned: Collection[ForwardMode],
    device_reads: bool,
) -> tuple[ForwardMode, ForwardMode, int]:
    """Reject a malformed batch, naming the field, before anything is staged; its mode, the
    mode that plans it (an idle batch's shape) and its query tokens (summed here once: a
    ragged replay's bucket check reads them).

    Structure only (types, ranks, devices, lengths, counts): value ranges are
    checked where the inputs are staged. ``next_n`` is each mode's tokens per
    request (absent: 1); ``planned`` the modes with a program (an idle batch's
    shape must be one). ``device_reads`` also compares the engine's device
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
    shape = batch.idle_as
    if shape is not _DECODE:  # an idle batch of another shape, or a wrong declaration
        shape = _check_shape(mode, shape, planned)
    want_n = next_n.get(mode if shape is _DECODE else shape, 1)
    if batch.next_n != want_n:
        what = mode.value if mode is not _IDLE else f"idle as {shape.value}"
        raise BatchError(
            f"next_n does not match the planner for mode {what} (its tokens per request)",
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
    return mode, shape if mode is _IDLE else mode, tokens


def _check_shape(mode: ForwardMode, value: object, planned: Collection[ForwardMode]) -> ForwardMode:
    """An ``idle_as`` other than decode: only an idle batch declares one, a uniform mode
    that has a program (it is planned with that mode's program and replays its graphs)."""
    if value == _DECODE:  # "decode" as a string (a str enum)
        return _DECODE
    if mode is not _IDLE:
        why = f"only an idle batch is shaped as another mode: a {mode.value} batch plans as itself"
        expected: object = _DECODE.value
    elif value not in _SHAPES:
        why = "an idle batch pads the graph of a uniform mode (ragged batches have none)"
        expected = [m.value for m in _SHAPES]
    elif ForwardMode(value) not in planned:
        why = "the planner does not plan the mode this idle batch is shaped as" + (
            " (draft decode needs Limits.draft_steps >= 1)" if value == _DRAFT_DECODE else ""
        )
        expected = [m.value for m in _SHAPES if m in planned]
    else:
        return ForwardMode(value)
    raise BatchError(why, field="idle_as", expected=expected, actual=getattr(value, "value", value))


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
        least, tokens = min_sum(lens)
        if least < 1:  # the token layout itself is undefined: not a range
            raise BatchError(
                "every request adds at least one token",
                field="extend_lens_cpu",
                expected=">= 1",
                actual=least,
            )
    if mode.ragged and tokens > max_tokens:
        raise BatchError(
            "more query tokens than max_tokens",
            field="extend_lens_cpu",
            expected=f"<= {max_tokens} tokens",
            actual=tokens,
        )
    return tokens


_SHORT = 64
"""Up to this many values a host tensor is reduced in Python, on its list: numpy's per-call
cost is most of the time of a short array's reductions (past about 96 numpy's wins)."""


def min_sum(values: torch.Tensor) -> tuple[int, int]:
    """The least (1 if empty) and the total of a host int32 tensor, the total in int64."""
    if values.shape[0] <= _SHORT:
        listed = values.tolist()
        return min(listed, default=1), sum(listed)
    array = values.numpy()
    return int(np.minimum.reduce(array)), int(np.add.reduce(array, dtype=np.int64))


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


def check_pad_to(
    pad_to: object, pad_tokens: object, bs: int, max_batch: int, max_tokens: int, mode: ForwardMode
) -> tuple[int | None, int | None]:
    """``plan(batch, pad_to=n, pad_tokens=t)``: a captured bucket's shape (a ragged one names
    both, a uniform one only ``pad_to``, which holds the batch); both as Python ints."""
    if pad_tokens is not None and not mode.ragged:
        raise BatchError(
            f"a {mode.value} batch pads requests only: leave pad_tokens out",
            field="pad_tokens",
            expected=None,
            actual=pad_tokens,
        )
    if pad_to is None:
        if pad_tokens is not None:
            raise BatchError("pad_tokens comes with pad_to", field="pad_to", actual=None)
        return None, None
    pad_to = check_size("pad_to", pad_to, bs, max_batch, "pad_to out of range")
    if not mode.ragged:
        return pad_to, None
    if pad_tokens is None:
        raise BatchError(
            "a ragged batch padded to a bucket names its token bucket too",
            field="pad_tokens",
            expected=f"an int in [1, {max_tokens}]",
            actual=None,
        )
    return pad_to, check_size("pad_tokens", pad_tokens, 1, max_tokens, "out of range")


def check_capture(
    mode: ForwardMode, bs: object, tokens: object, max_batch: int, max_tokens: int
) -> tuple[int, int | None]:
    """``capture(bs, mode, tokens=)``: a capturable mode (idle replays its shape's graphs), a
    size in range, and for a ragged mode its token bucket in ``[1, max_tokens]`` (a bucket
    smaller than ``bs`` holds batches of as many requests as tokens at most), else none;
    both as Python ints."""
    if mode is ForwardMode.IDLE:
        raise BatchError(
            "idle batches replay the graphs of their shape (idle_as): capture that mode",
            field="mode",
            expected=[m.value for m in ForwardMode if m is not ForwardMode.IDLE],
            actual=mode.value,
        )
    bs = check_size("bs", bs, 1, max_batch, "capture size out of range")
    if not mode.ragged:
        if tokens is not None:
            raise BatchError(
                f"a {mode.value} capture's tokens follow from bs: leave tokens out",
                field="tokens",
                expected=None,
                actual=tokens,
            )
        return bs, None
    if tokens is None:
        raise BatchError(
            f"a {mode.value} capture names its token bucket",
            field="tokens",
            expected=f"an int in [1, {max_tokens}]",
            actual=None,
        )
    return bs, check_size("tokens", tokens, 1, max_tokens, "token bucket out of range")


def check_bucket(batch: ForwardBatch, real: int, tokens: int, kv_tokens: int, name: str) -> None:
    """A ragged batch of ``real`` query tokens fits a bucket of ``tokens`` (padding requests
    add none) and its KV lengths' sum the stated bound ``kv_tokens``
    (``Limits.kv_token_capacity``; the flat KV holds the padding requests' entries on top).
    ``name``: the argument that named the token bucket."""
    if real > tokens:
        raise BatchError(
            "more query tokens than the token bucket",
            field=name,
            expected=f">= {real}",
            actual=tokens,
        )
    kv = min_sum(batch.seq_lens_cpu)[1]
    if kv > kv_tokens:
        raise BatchError(
            "KV tokens past the bound of a captured ragged batch (Limits.ragged_kv_tokens): "
            "the step runs eagerly",
            field="seq_lens_cpu",
            expected=f"<= {kv_tokens} in all",
            actual=kv,
        )


_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


class ElementBounds:
    """Inclusive bounds of each element of a staged int32 buffer (int64 arrays ``lo``,
    ``hi``; an unchecked element has every int32), and the pass that checks them.

    The pass runs as one subtraction, one comparison and one count: with the bounds
    clipped to int32, ``value - lo`` (int32, wrapping) read as unsigned is past
    ``span = hi - lo`` exactly when ``value`` is outside ``[lo, hi]``. Where some range
    holds no int32 at all (``lo > hi``), or the bounds serve one batch only (not
    ``one_pass``: making the arrays would cost more than they save), the two comparisons
    of the int64 bounds run instead, as they do to find the first bad element. ``owner``
    is kept alive with the bounds (staging keys them by its id).
    """

    __slots__ = ("lo64", "hi64", "lo", "span", "owner")

    def __init__(self, lo: np.ndarray, hi: np.ndarray, owner: object, *, one_pass: bool) -> None:
        self.lo64, self.hi64, self.owner = lo, hi, owner
        self.lo = self.span = None
        if one_pass:
            low, high = np.maximum(lo, _INT32[0]), np.minimum(hi, _INT32[1])
            if not (low > high).any():
                self.lo = low.astype(np.int32)
                self.span = (high - low).astype(np.uint32)

    def outside(self, flat: np.ndarray, allowed: int = 0) -> bool:
        """Whether more than ``allowed`` elements of ``flat`` (int32) are outside their range
        (a bucket's padding rows whose pad is outside by design)."""
        if self.span is None:
            return np.count_nonzero((flat < self.lo64) | (flat > self.hi64)) > allowed
        # count_nonzero rather than any(): the cheaper reduction of the two
        return np.count_nonzero((flat - self.lo).view(np.uint32) > self.span) > allowed

    def first_outside(self, flat: np.ndarray) -> int:
        """The index of the first element outside its range (there is one)."""
        return int(np.flatnonzero((flat < self.lo64) | (flat > self.hi64))[0])


_SMALL = 48
"""Up to this many values a Python set beats numpy's sort (numpy's per-call cost dominates
small arrays; past about 64 values the sort wins)."""


def first_duplicate(values: np.ndarray) -> int | None:
    """The smallest value other than the null 0 that occurs more than once, else None."""
    size = values.size
    if size < 2:
        return None
    if size <= _SMALL:
        listed = values.tolist()
        if len(set(listed)) == size:  # the usual case, answered at once
            return None
    ordered = np.sort(values)
    same = ordered[1:] == ordered[:-1]
    repeats = np.count_nonzero(same)  # cheaper than same.any()
    if not repeats:  # the usual case past _SMALL: no equal neighbours at all
        return None
    # Sorted, the zeros come first (values are range-checked to >= 0 before): zeros alone
    # account for zeros - 1 equal neighbours, anything past that is a real repeat.
    zeros = int(ordered.searchsorted(1))
    if repeats <= max(zeros - 1, 0):
        return None
    same[: max(zeros - 1, 0)] = False
    return int(ordered[1:][same][0])


def check_unique(field: str, values: np.ndarray, what: str) -> None:
    """Refuse a value that occurs twice in ``values`` (the real entries of one input)."""
    value = first_duplicate(values)
    if value is not None:
        where = np.flatnonzero(values == value)[:2].tolist()
        raise BatchError(
            f"{what} twice in one batch (entries {where[0]} and {where[1]})",
            field=field,
            expected="distinct values (0, the null entry, may repeat)",
            actual=value,
        )


def all_distinct(first: np.ndarray, second: np.ndarray) -> bool:
    """Whether no value occurs twice in ``first`` and none in ``second``, the null 0 included.

    A screen for :func:`check_unique` of two inputs at once (slots and pool rows): True
    means neither has a repeat; False only that one may, and :func:`check_unique` of each
    then says which (0 may repeat there). One sort of both serves: ``second`` is stored
    bitwise inverted (``~v = -v - 1``), so range-checked values (``>= 0``) of the two
    cannot meet, and whatever the values, merging arrays never hides a repeat.
    """
    n, total = first.size, first.size + second.size
    if total <= _SMALL:
        a, b = first.tolist(), second.tolist()
        return len(set(a)) == len(a) and len(set(b)) == len(b)
    both = np.empty(total, dtype=np.result_type(first, second))
    both[:n] = first
    np.invert(second, out=both[n:])
    both.sort()
    return not np.count_nonzero(both[1:] == both[:-1])


_SMALL_POSITIONS = 16
"""Up to this many requests a decode batch's positions are compared in Python."""


def check_positions(positions: np.ndarray, lens: np.ndarray, new: np.ndarray | int | None) -> None:
    """Given positions must be what the lengths imply: request ``b`` of KV length ``L``
    adding ``n`` tokens holds positions ``L - n .. L - 1`` (``new`` None: one token each;
    an int: that many each, as in a verify batch)."""
    if new is None:  # decode: one token per request, at L - 1
        if lens.size <= _SMALL_POSITIONS and positions.tolist() == [n - 1 for n in lens.tolist()]:
            return  # the usual case, in Python: numpy's call overhead is most of the cost
        implied = lens - 1
    elif isinstance(new, int):  # n tokens each: L - n .. L - 1, one broadcast add
        implied = (lens[:, None] + _tails(new)).reshape(-1)
    else:  # token i of request b at L_b - ends_b + i: int32 (range-checked, <= max_tokens)
        implied = np.repeat(lens - np.add.accumulate(new, dtype=np.int32), new)
        implied += _first(implied.size)
    differ = positions != implied
    if np.count_nonzero(differ):  # one count in the usual case; the index only when wrong
        i = int(differ.argmax())
        raise BatchError(
            "positions disagree with the lengths (a request of KV length L adding n tokens "
            f"holds positions L-n .. L-1); first at token {i}",
            field="positions",
            expected=int(implied[i]),
            actual=int(positions[i]),
        )


_COUNT = [np.arange(0, dtype=np.int32)]


def _first(n: int) -> np.ndarray:
    """``0 .. n - 1`` as int32, a view of one array kept (grown to the largest ``n`` asked)."""
    have = _COUNT[0]
    if have.size < n:
        have = _COUNT[0] = np.arange(max(n, 2 * have.size), dtype=np.int32)
    return have[:n]


_TAILS: dict[int, np.ndarray] = {}


def _tails(n: int) -> np.ndarray:
    """``[-n, ..., -1]`` as int32 (cached: one per ``next_n``): what the last ``n`` positions
    of a request add to its KV length."""
    tails = _TAILS.get(n)
    if tails is None:
        tails = _TAILS[n] = np.arange(-n, 0, dtype=np.int32)
    return tails


def uniform_positions(lens: np.ndarray, n: int, out: np.ndarray) -> None:
    """The positions of a batch adding ``n`` tokens to each request, written into ``out``
    (int32, ``lens.size * n``): ``L - n .. L - 1`` per request, request-major, as
    ``planner.batch.implied_positions`` derives them, in one ufunc call."""
    if n == 1:
        np.subtract(lens, 1, out=out)
    else:
        np.add(lens[:, None], _tails(n), out=out.reshape(-1, n))


def check_table_entries(
    table: torch.Tensor, pools: np.ndarray, lens: np.ndarray, kv_slots: int | None
) -> None:
    """Every token table entry the plans read (row ``pools[b]``, columns ``< lens[b]``) is a
    slot in ``[0, kv_slots)`` (only ``>= 0`` without ``kv_slots``). A device read where the
    table lives on the device. Pools and lengths are already range-checked."""
    if not lens.size:
        return
    high = kv_slots if kv_slots is not None else _NO_LIMIT
    find = first_bad_entry_numpy if table.device.type == "cpu" else first_bad_entry_torch
    found = find(table, pools, lens, high)
    if found is None:
        return
    b, col, value = found
    raise BatchError(
        f"token table entry outside the KV cache (req_to_token[{int(pools[b])}, {col}], "
        f"request {b})",
        field="req_to_token",
        expected=f"[0, {high - 1}]",
        actual=value,
    )


_NO_LIMIT = np.iinfo(np.int32).max + 1
"""Without ``kv_slots`` only negative entries are wrong: every int32 is below 2**31."""


def first_bad_entry_numpy(
    table: torch.Tensor, pools: np.ndarray, lens: np.ndarray, high: int
) -> tuple[int, int, int] | None:
    """``(request, column, value)`` of the first entry outside ``[0, high)``, on the host."""
    longest = int(lens.max())
    rows = table.numpy()[pools.astype(np.int64), :longest]
    # one comparison for both bounds (a negative slot is a huge unsigned one); the columns
    # past each length are masked out only when something is out of range at all
    if not (rows.view(np.uint32) >= high).any():
        return None
    used = np.arange(longest) < lens[:, None]
    bad = used & ((rows < 0) | (rows >= high))
    if not bad.any():
        return None
    b, col = (int(i[0]) for i in np.nonzero(bad))
    return b, col, int(rows[b, col])


def first_bad_entry_torch(
    table: torch.Tensor, pools: np.ndarray, lens: np.ndarray, high: int
) -> tuple[int, int, int] | None:
    """The same where the table lives, one sync. The upper bound is compared only when it is
    an int32: torch wraps a larger Python int to the tensor's dtype (2**31 would become
    -2**31 and flag every entry)."""
    longest = int(lens.max())
    index = torch.from_numpy(pools.astype(np.int64)).to(table.device)
    rows = table.index_select(0, index)[:, :longest]
    limit = torch.from_numpy(lens.astype(np.int64)).to(table.device)
    used = torch.arange(longest, device=table.device) < limit[:, None]
    wrong = rows < 0
    if high < _NO_LIMIT:
        wrong |= rows >= high
    found = torch.nonzero(used & wrong)[:1].cpu()  # the one sync
    if not found.numel():
        return None
    b, col = int(found[0, 0]), int(found[0, 1])
    return b, col, int(rows[b, col])
