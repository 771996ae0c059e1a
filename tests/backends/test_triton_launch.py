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
