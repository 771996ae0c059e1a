"""The token table check: its host and device paths agree (the device one runs here over a
CPU tensor), including without ``kv_slots``, where only negative entries are wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from planner import checks as value_checks


@pytest.mark.parametrize("kv_slots", [None, 300, 2**31 - 1])
def test_the_token_table_check_finds_the_same_entry_on_the_host_and_with_torch(kv_slots):
    """The device path runs only on CUDA; here it runs over a CPU tensor, against the host
    path: both must find the same first bad entry, or none (torch wraps 2**31 to int32)."""
    high = kv_slots if kv_slots is not None else value_checks._NO_LIMIT
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        table = torch.randint(0, 400, (8, 32), generator=gen, dtype=torch.int32)
        if trial % 3 == 0:
            table[3, 5] = -7
        pools = np.array([1, 3, 5], dtype=np.int64)
        lens = np.array([32, 10, 3 + trial % 29], dtype=np.int32)
        host = value_checks.first_bad_entry_numpy(table, pools, lens, high)
        device = value_checks.first_bad_entry_torch(table, pools, lens, high)
        assert host == device
        if kv_slots is None:
            assert (host is None) == (trial % 3 != 0)


def _first_duplicate_reference(values: list[int]) -> int | None:
    seen, repeated = set(), set()
    for v in values:
        (repeated if v in seen else seen).add(v)
    repeated.discard(0)  # the null entry may repeat
    return min(repeated) if repeated else None


@pytest.mark.parametrize("size", [0, 1, 2, 7, 64, 128, 129, 256, 1000])
def test_first_duplicate_equals_the_reference(size):
    """Every size, both sides of the small-input shortcut, with and without zeros and repeats."""
    rng = np.random.default_rng(size)
    for trial in range(60):
        high = [3, size + 1, 10 * size + 10][trial % 3]
        values = rng.integers(0, max(high, 1), size).astype(np.int32)
        if trial % 4 == 0:
            values = rng.permutation(max(size, 1) * 5)[:size].astype(np.int32)  # distinct
        got = value_checks.first_duplicate(values)
        assert got == _first_duplicate_reference(values.tolist()), values


@pytest.mark.parametrize("size", [1, 5, 16, 17, 64, 256])
def test_check_positions_refuses_exactly_the_wrong_ones(size):
    rng = np.random.default_rng(size)
    for trial in range(40):
        lens = rng.integers(1, 5000, size).astype(np.int32)
        new = None if trial % 2 else rng.integers(1, 4, size).astype(np.int32)
        new_ = np.ones(size, np.int32) if new is None else np.minimum(new, lens)
        positions = np.concatenate(
            [np.arange(L - n, L, dtype=np.int32) for L, n in zip(lens, new_)]
        )
        value_checks.check_positions(positions, lens, None if new is None else new_)
        if trial % 3 == 0:
            i = int(rng.integers(0, positions.size))
            positions[i] += 1
            with pytest.raises(Exception, match="positions disagree") as err:
                value_checks.check_positions(positions, lens, None if new is None else new_)
            assert f"first at token {i}" in str(err.value)


def _repeats(values: list[int]) -> bool:
    return len(set(values)) != len(values)


@pytest.mark.parametrize(
    "sizes",
    [(0, 0), (1, 1), (5, 3), (24, 24), (25, 24), (64, 64), (256, 256), (512, 256), (3, 300)],
)
def test_all_distinct_equals_the_reference(sizes):
    """``all_distinct`` (one sort of both arrays, or sets when small) says True exactly when
    neither array repeats a value, zeros included; True then implies no first_duplicate."""
    rng = np.random.default_rng(sum(sizes))
    n, m = sizes
    for trial in range(80):
        high = [2, n + m + 1, 10 * (n + m) + 10, 2**31 - 1][trial % 4]
        first = rng.integers(0, high, n).astype(np.int32)
        second = rng.integers(0, min(high, 4000), m).astype(np.int32)
        if trial % 3 == 0:  # distinct, zeros and all, and equal values across the two
            first = rng.permutation(max(n, m) * 3 + 1)[:n].astype(np.int32)
            second = rng.permutation(max(n, m) * 3 + 1)[:m].astype(np.int32)
        if trial % 5 == 0 and n > 1:
            first[rng.integers(0, n)] = 0
            first[rng.integers(0, n)] = 0  # the null slot, maybe twice
        want = not _repeats(first.tolist()) and not _repeats(second.tolist())
        got = value_checks.all_distinct(first, second)
        assert got == want, (first, second)
        if got:
            assert value_checks.first_duplicate(first) is None
            assert value_checks.first_duplicate(second) is None


@pytest.mark.parametrize("size", [47, 48, 49])
def test_first_duplicate_either_side_of_the_set_shortcut(size):
    rng = np.random.default_rng(size)
    for trial in range(200):
        values = rng.integers(0, [3, size, 4 * size][trial % 3], size).astype(np.int32)
        assert value_checks.first_duplicate(values) == _first_duplicate_reference(values.tolist())


@pytest.mark.parametrize("size", [0, 1, 16, 17, 64, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_uniform_positions_and_checks_equal_the_general_derivation(size, n):
    """Positions of ``n`` tokens per request: written in place, and checked with an int
    ``new``, exactly as the general path (``implied_positions``, an array ``new``) does."""
    from planner.batch import implied_positions

    rng = np.random.default_rng(size * 10 + n)
    lens = rng.integers(n, 5000, size).astype(np.int32)
    new = np.full(size, n, np.int32)
    want = implied_positions(lens, new)
    out = np.full(size * n + 3, -9, np.int32)
    value_checks.uniform_positions(lens, n, out[: size * n])
    assert out[: size * n].tolist() == want.tolist() and out[size * n :].tolist() == [-9] * 3
    value_checks.check_positions(want, lens, n)
    value_checks.check_positions(want, lens, new)
    if size:
        i = int(rng.integers(0, size * n))
        bad = want.copy()
        bad[i] -= 1
        messages = []
        for how in (n, new):
            with pytest.raises(Exception, match="positions disagree") as err:
                value_checks.check_positions(bad, lens, how)
            messages.append(str(err.value))
        assert messages[0] == messages[1] and f"first at token {i}" in messages[0]
