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
TOKEN_FIELD = "token_sizes"
"""The config field a ragged (extend, mixed) token ladder override comes from."""


def default_capture_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 beyond, and ``max_batch``; ascending."""
    check_positive(max_batch)
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_batch + 1, 16)]
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


_FINE_FROM = 256
"""The token bucket past which the default ladder steps by a quarter of a doubling."""
MAX_PADDING = 0.25
"""The most padding, as a share of a step's real tokens, that the default ladder gives a step
of more than :data:`_FINE_FROM` tokens."""


def default_token_ladder(max_tokens: int, reqs: int) -> list[int]:
    """Token buckets of ragged (extend, mixed) graphs: 16, 32, 64, 128, 256, then four a
    doubling (320, 384, 448, 512, 640, 768, 896, 1024, 1280, ...), and ``max_tokens``.

    Up to 256 tokens the buckets double: the forward's GEMMs there cost about the same
    padded or not (their weights' bytes dominate), so more graphs would buy nothing. Past
    it they are compute-bound and a padded token costs what a real one does (on
    dsv32-shapes a 272-token mixed step replayed at 512 tokens spent 26.7 ms in GEMMs
    against 18.5 ms eagerly; docs/benchmarks.md, issue 37), so each bucket there is at most
    1.25x the one below it: a step of ``t > 256`` tokens pads by less than ``t / 4``
    (:data:`MAX_PADDING`). The engine's scheduler fills a loaded step to exactly its token
    budget, decode rows included (``max_tokens``, the top bucket). No bucket equals
    ``reqs``, the request bucket of ragged graphs: an output with that many rows could be
    per token or per request, so it could not be sliced; such a bucket moves up by one
    token (down, at ``max_tokens``: a batch of exactly ``max_tokens`` tokens then runs
    eagerly, counted).
    """
    check_positive(max_tokens, "max_tokens")
    sizes = {1 << k for k in range(4, _FINE_FROM.bit_length())}
    base = _FINE_FROM
    while base < max_tokens:
        sizes.update(base + base * quarter // 4 for quarter in range(1, 5))
        base *= 2
    sizes = {s for s in sizes if s < max_tokens}
    sizes.add(max_tokens)
    if reqs in sizes:
        sizes.discard(reqs)
        sizes.add(reqs + 1 if reqs < max_tokens else reqs - 1)
    return sorted(s for s in sizes if s >= 1)


def check_ragged_cap(
    cap: int | None, reqs: int, listed: bool, field: str = "ragged_max_tokens"
) -> None:
    """A cap on the default token ladder (``ragged_max_tokens``) must cap that ladder (not
    beside a ladder given as a list: ``listed``) and exceed the request bucket ``reqs``: a
    mixed step holds a row for each decoding request, up to ``max_batch``. ``field``: the
    name the caller's users know it by."""
    if cap is None:
        return
    if listed:
        raise ConfigError(
            "ragged_max_tokens caps the default token ladder; a ladder given as a list "
            "(token_sizes) sets its own top",
            field=field,
            expected=f"unset with {field.removesuffix('ragged_max_tokens')}token_sizes",
            actual=cap,
        )
    if cap <= reqs:
        raise ConfigError(
            "the largest token bucket must exceed the request bucket: a mixed step holds "
            "a row for each decoding request",
            field=field,
            expected=f"> {reqs} (planner.max_batch)",
            actual=cap,
        )


def token_ladder(max_tokens: int, reqs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The ragged token buckets: the default ladder, or a validated override (the rules of
    :func:`capture_ladder`, bounded by ``max_tokens``; ``reqs`` itself is refused)."""
    if sizes is None:
        return default_token_ladder(max_tokens, reqs)
    values = capture_ladder(max_tokens, sizes, field=TOKEN_FIELD, limit="max_tokens")
    if reqs in values:
        raise ConfigError(
            "a token bucket equal to the request bucket (max_batch) makes per-token and "
            "per-request outputs indistinguishable",
            field=TOKEN_FIELD,
            expected=f"no bucket of {reqs}",
            actual=values,
        )
    return values


def capture_ladder(
    max_batch: int,
    sizes: Sequence[int] | None = None,
    *,
    field: str = FIELD,
    limit: str = "max_batch",
) -> list[int]:
    """The sizes to capture, ascending: the default ladder, or a validated override.

    An override is taken as written (it need not reach ``max_batch``: larger
    batches then run eagerly, counted as fallbacks), but it must be positive
    integers, at most ``max_batch``, strictly ascending: a silently re-sorted
    or de-duplicated list would hide a typo in a config.
    """
    if sizes is None:
        return default_capture_ladder(max_batch)
    check_positive(max_batch, limit)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError("capture sizes must be a list of integers", field=field, actual=sizes)
    values = list(sizes)
    if not values:
        raise ConfigError(
            "capture sizes are empty (disable graphs instead)",
            field=field,
            expected=">= 1 size",
            actual=values,
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError("capture size is not an integer", field=field, actual=value)
        if value < 1:
            raise ConfigError(
                "capture size must be positive", field=field, expected=">= 1", actual=value
            )
        if value > max_batch:
            raise ConfigError(
                f"capture size exceeds {limit}",
                field=field,
                expected=f"<= {max_batch}",
                actual=value,
            )
    for left, right in pairwise(values):
        if right <= left:
            raise ConfigError(
                "capture sizes must be sorted and unique",
                field=field,
                expected="strictly ascending",
                actual=values,
            )
    return values


def check_positive(value: int, name: str = "max_batch") -> None:
    """A count of requests or tokens the ladders are built for: an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name} must be a positive integer", field=name, expected=">= 1", actual=value
        )
