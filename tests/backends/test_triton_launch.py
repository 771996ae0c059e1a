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


_BROKEN = {
    "int64 slots": lambda t: (t[0].long(), *t[1:]),
    "int16 pool": lambda t: (*t[:3], t[3].short(), t[4]),
    "3-D table": lambda t: (t[0], t[1], t[2][None], *t[3:]),
    "2-D lengths": lambda t: (*t[:4], t[4][None]),
    "short lengths": lambda t: (*t[:4], t[4][:-1]),
    "strided slots": lambda t: (torch.stack([t[0], t[0]], 2)[..., 0], *t[1:]),
    "strided pool": lambda t: (*t[:3], torch.stack([t[3], t[3]], 1)[:, 0], t[4]),
    "pages on meta": lambda t: (t[0], t[1].to("meta"), *t[2:]),
    "no rows": lambda t: tuple(x[:0] for x in t[:2]) + (t[2],) + tuple(x[:0] for x in t[3:]),
}


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.integers(1, 5),
    width=st.integers(0, 300),
    n_pages=st.integers(0, 9),
    ctx=st.integers(1, 300),
    pool_dtype=st.sampled_from([torch.int32, torch.int64]),
    page_size=st.integers(-1, 2**31) | st.just(True),
    broken=st.sampled_from([None, *sorted(_BROKEN)]),
)
def test_the_one_pass_launch_is_the_three_calls_it_replaces(
    reqs, width, n_pages, ctx, pool_dtype, page_size, broken
):
    """``plain_launch`` is ``_plainly_valid``, then ``launch_args(contiguous=True)`` and
    ``known_kinds``, for non-empty tables; None wherever those would not all hold."""
    from backends.common.token_table_triton import (
        _plainly_valid,
        known_kinds,
        launch_args,
        plain_launch,
    )

    i32 = torch.int32
    tensors = (
        torch.zeros(reqs, width, dtype=i32),
        torch.zeros(reqs, n_pages, dtype=i32),
        torch.zeros(reqs + 1, ctx, dtype=i32),
        torch.zeros(reqs, dtype=pool_dtype),
        torch.zeros(reqs, dtype=i32),
    )
    if broken is not None:
        tensors = _BROKEN[broken](tensors)
    got = plain_launch(*tensors, page_size)
    plain = _plainly_valid(*tensors, page_size)
    if not plain or tensors[0].shape[0] == 0 or (width == 0 and n_pages == 0):
        assert got is None
        return
    grid, args, constexprs = launch_args(*tensors, page_size, contiguous=True)
    assert got is not None
    kinds, got_grid, got_args, got_constexprs = got
    assert (got_grid, got_constexprs) == (grid, constexprs)
    assert len(got_args) == len(args) and all(a is b or a == b for a, b in zip(got_args, args))
    assert kinds == known_kinds(args)
