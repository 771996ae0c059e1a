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
they may repeat.
"""

from __future__ import annotations

import numpy as np
import torch

from planner.batch import implied_positions
from planner.errors import BatchError

_SMALL = 128
"""Up to this many values a Python set beats numpy's sort (~0.4 us against ~3.5 us at 8)."""


def first_duplicate(values: np.ndarray) -> int | None:
    """The smallest value other than the null 0 that occurs more than once, else None."""
    if values.size < 2:
        return None
    if values.size <= _SMALL:
        listed = values.tolist()
        if len(set(listed)) == len(listed):  # the usual case, answered at once
            return None
    ordered = np.sort(values)
    same = ordered[1:] == ordered[:-1]
    # Sorted, the zeros come first (values are range-checked to >= 0 before): zeros alone
    # account for zeros - 1 equal neighbours, anything past that is a real repeat.
    zeros = int(ordered.searchsorted(1))
    if np.count_nonzero(same) <= max(zeros - 1, 0):
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


def check_positions(positions: np.ndarray, lens: np.ndarray, new: np.ndarray | None) -> None:
    """Given positions must be what the lengths imply: request ``b`` of KV length ``L``
    adding ``n`` tokens holds positions ``L - n .. L - 1`` (``new`` None: one token each)."""
    if new is None:  # decode: one token per request, at L - 1
        if lens.size <= 16 and positions.tolist() == [n - 1 for n in lens.tolist()]:
            return  # the usual case, in Python: numpy's call overhead is most of the cost
        implied = lens - 1
    else:
        implied = implied_positions(lens, new)
    differ = positions != implied
    if differ.any():  # one reduction in the usual case; the index only when something is wrong
        i = int(differ.argmax())
        raise BatchError(
            "positions disagree with the lengths (a request of KV length L adding n tokens "
            f"holds positions L-n .. L-1); first at token {i}",
            field="positions",
            expected=int(implied[i]),
            actual=int(positions[i]),
        )


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
