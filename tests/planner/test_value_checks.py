"""The token table check: its host and device paths agree (the device one runs here over a
CPU tensor), including without ``kv_slots``, where only negative entries are wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from planner import value_checks


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
