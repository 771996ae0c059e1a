"""Timings a run records without growing with it: the latest values, and exact totals.

A server that never stops must not keep a float per step or per request forever.
:class:`Samples` keeps the most recent ``capacity`` values (8 bytes each, in an
``array``) for percentiles, and the count and sum of all of them for the mean.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

CAPACITY = 1 << 16
"""Values kept for percentiles: 512 KiB at most, more than any shipped run takes."""


class Samples:
    """Append-only timings; iterates over the kept values, oldest first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.count = 0
        """Values appended in all (kept or not)."""
        self.total = 0.0
        """Their sum."""
        self._values = array("d")
        self._next = 0  # where the next value goes once the array is full

    def append(self, value: float) -> None:
        self.count += 1
        self.total += value
        if len(self._values) < self.capacity:
            self._values.append(value)
        else:
            self._values[self._next] = value
            self._next = (self._next + 1) % self.capacity

    @property
    def mean(self) -> float:
        """Mean of every value appended (0 when none)."""
        return self.total / self.count if self.count else 0.0

    def __len__(self) -> int:
        """Values kept (``count`` until it exceeds ``capacity``)."""
        return len(self._values)

    def __iter__(self) -> Iterator[float]:
        values = self._values
        yield from values[self._next :]
        yield from values[: self._next]

    def __getitem__(self, index: int | slice) -> float | list[float]:
        return list(self)[index]
