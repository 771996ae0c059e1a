"""Relations between a batch's values that ranges alone cannot catch.

Each input can be in range and the batch still be wrong: two tokens writing one KV slot
(a race on the GPU), one request twice in a batch, positions that disagree with the
lengths (rope at the wrong position), a token table entry past the KV cache (a page id
past the cache). The first three are checked on the staged host values, vectorised, in
every phase (microseconds at serving batch sizes; see ``docs/reliability.md``); the
token table is engine memory on the device: its entries are read in eager ``plan()`` when
the table is on the host (free), and on a GPU at capture and in debug mode only, where a
device read is allowed. Reading them in every eager plan on a GPU would synchronise with
the device each time (measured on the H200: about 0.5 ms a plan, and a stall behind
whatever the GPU has queued); debug mode is where an engine bug of this kind is hunted.

The null request (row 0) and the null slot 0 are this repository's padding convention:
they may repeat. ``ElementBounds`` is the range pass ``planner.staging`` runs before these
(every staged value within its input's limits), in as few numpy calls as it takes.
"""

from __future__ import annotations

import numpy as np
import torch

from planner.batch import implied_positions
from planner.errors import BatchError

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

    def outside(self, flat: np.ndarray) -> bool:
        """Whether any element of ``flat`` (int32) is outside its range."""
        if self.span is None:
            return bool(np.count_nonzero((flat < self.lo64) | (flat > self.hi64)))
        # count_nonzero rather than any(): 0.2 us against 1 us
        return bool(np.count_nonzero((flat - self.lo).view(np.uint32) > self.span))

    def first_outside(self, flat: np.ndarray) -> int:
        """The index of the first element outside its range (there is one)."""
        return int(np.flatnonzero((flat < self.lo64) | (flat > self.hi64))[0])


_SMALL = 48
"""Up to this many values a Python set beats numpy's sort (measured on the CPU host: 0.4
against 1.8 us at 8 values, 1.5 against 1.9 at 48, even at 64; 6.6 against 2.1 at 256)."""


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
    repeats = np.count_nonzero(same)  # 0.2 us, where same.any() costs 1 us
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
    else:
        implied = implied_positions(lens, new)
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
