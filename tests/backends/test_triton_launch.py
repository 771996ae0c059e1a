"""``LazyKernel.launch``'s decisions, on any machine: when a launch hook counts as set, and
the per-argument key of the direct launch (the launch itself is tested on CUDA, in
``tests/gpu/test_triton_launch_gpu.py``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common.triton_launch import _arg_kind, _hook_set, _kinds


def test_launch_hooks_are_seen_as_set_only_when_some_hook_is_there():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None)
    assert not _hook_set(Chain([]))
    assert _hook_set(Chain([print]))
    assert _hook_set(print)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.integers(-(2**64), 2**64)
        | st.booleans()
        | st.floats(allow_nan=False)
        | st.sampled_from([torch.int32, torch.int64, torch.float32]).map(
            lambda dt: torch.zeros(3, dtype=dt)[1:]
        ),
        max_size=8,
    ),
    aligned=st.booleans(),
)
def test_launch_keys_inline_the_same_kinds(values, aligned):
    """The direct launch's key per argument (inlined for speed) is ``_arg_kind``'s: an int's
    width, a tensor's dtype (and alignment where kept), None (Triton's run) for the rest."""
    assert _kinds(tuple(values), aligned) == [_arg_kind(v, aligned) for v in values]


@settings(max_examples=100, deadline=None)
@given(
    reqs=st.integers(1, 5),
    width=st.integers(0, 300),
    n_pages=st.integers(0, 9),
    ctx=st.integers(1, 300),
    pool_dtype=st.sampled_from([torch.int32, torch.int64]),
    page_size=st.integers(1, 2**31 - 1),
)
def test_the_token_tables_own_kinds_and_strides_are_the_launchs(
    reqs, width, n_pages, ctx, pool_dtype, page_size
):
    """What the fused token table hands the direct launch once its fast checks passed (its
    own key, the rows' lengths for strides) is what the launch would work out itself."""
    from backends.common.token_table_triton import _plainly_valid, known_kinds, launch_args

    i32 = torch.int32
    tensors = (
        torch.zeros(reqs, width, dtype=i32),
        torch.zeros(reqs, n_pages, dtype=i32),
        torch.zeros(reqs + 1, ctx, dtype=i32),
        torch.zeros(reqs, dtype=pool_dtype),
        torch.zeros(reqs, dtype=i32),
    )
    assert _plainly_valid(*tensors, page_size)
    grid, args, constexprs = launch_args(*tensors, page_size, contiguous=True)
    want_grid, want, want_constexprs = launch_args(*tensors, page_size)
    assert (grid, args[:-3], constexprs) == (want_grid, want[:-3], want_constexprs)
    for table, stride, real in zip((tensors[0], tensors[1], tensors[2]), args[-3:], want[-3:]):
        if table.shape[0] > 1 and table.numel():  # else no row offset is ever taken
            assert stride == real
    assert known_kinds(args) == tuple(_kinds(args, False))
    for big in (2**31, -1):  # a size the launch would key otherwise: worked out by it
        assert known_kinds((*args[:-1], big)) is None
