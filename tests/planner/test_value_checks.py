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
