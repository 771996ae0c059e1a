"""Which batch sizes get a CUDA graph.

A graph replays only at the size it was captured with, so a batch runs on the
smallest captured size that holds it and the rest are padding rows. Dense
small sizes (1, 2, 4, 8) keep the waste low where decode spends most steps;
steps of 8 up to 64 and of 16 beyond bound the waste at 15 rows while keeping
the number of graphs (capture time, pool memory) small. ``max_batch`` itself
is always captured so no admissible batch falls back to eager by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from planner.errors import ConfigError

FIELD = "capture_sizes"
"""The config field an override comes from; errors name it."""


def default_capture_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 beyond, and ``max_batch``; ascending."""
    _check_max_batch(max_batch)
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_batch + 1, 16)]
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def capture_ladder(max_batch: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The sizes to capture, ascending: the default ladder, or a validated override.

    An override is taken as written (it need not reach ``max_batch``: larger
    batches then run eagerly, counted as fallbacks), but it must be positive
    integers, at most ``max_batch``, strictly ascending: a silently re-sorted
    or de-duplicated list would hide a typo in a config.
    """
    if sizes is None:
        return default_capture_ladder(max_batch)
    _check_max_batch(max_batch)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError("capture sizes must be a list of integers", field=FIELD, actual=sizes)
    values = list(sizes)
    if not values:
        raise ConfigError(
            "capture sizes are empty (disable graphs instead)",
            field=FIELD,
            expected=">= 1 size",
            actual=values,
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError("capture size is not an integer", field=FIELD, actual=value)
        if value < 1:
            raise ConfigError(
                "capture size must be positive", field=FIELD, expected=">= 1", actual=value
            )
        if value > max_batch:
            raise ConfigError(
                "capture size exceeds max_batch",
                field=FIELD,
                expected=f"<= {max_batch}",
                actual=value,
            )
    for left, right in pairwise(values):
        if right <= left:
            raise ConfigError(
                "capture sizes must be sorted and unique",
                field=FIELD,
                expected="strictly ascending",
                actual=values,
            )
    return values


def _check_max_batch(max_batch: int) -> None:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(
            "max_batch must be a positive integer", field="max_batch", actual=max_batch
        )
