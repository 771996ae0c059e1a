"""An eager plan's sizes from its host lengths: the compiled (max, sum) equals numpy's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import native
from planner.dims import lengths_max_sum


def _numpy(x: torch.Tensor, empty_max: int) -> tuple[int, int]:
    values = x.numpy()
    return (int(values.max()), int(values.sum())) if values.size else (empty_max, 1)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    wide=st.booleans(),
    step=st.sampled_from([1, 2]),
)
def test_the_compiled_max_and_sum_equal_numpys(values, wide, step):
    dtype = torch.int64 if wide else torch.int32
    x = torch.tensor(values, dtype=torch.int64)
    if not wide:
        x = x.to(torch.int32)  # wraps into int32 range, like any int32 length tensor
    x = x[::step]  # a strided view takes the numpy path
    with np.errstate(over="ignore"):
        assert lengths_max_sum(x, 5) == _numpy(x, 5)
    assert x.dtype == dtype


@pytest.mark.skipif(native.max_sum() is None, reason="no C compiler")
def test_the_compiled_path_declines_what_it_cannot_read():
    fast = native.max_sum()
    assert fast(torch.zeros(0, dtype=torch.int32)) is None
    assert fast(torch.arange(6, dtype=torch.int32)[::2]) is None
    assert fast(torch.ones(3, dtype=torch.int16)) is None
    assert fast(torch.tensor([3, 9, 2], dtype=torch.int32)) == (9, 14)
