"""Every host twin's compiled form writes exactly what its numpy twin writes, or declines.

The numpy twins are the authority (``test_host_twins`` holds them to the torch
references); the compiled ones run in front of them in every eager plan. On the valid
inputs of ``test_host_twins`` each must take the case and agree bit for bit; on hostile
inputs (unsorted offsets, wrong lengths, any int32) each must agree or decline, never
write something else, and never write outside its output.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import native
from planner.ops import all_ops, get_op
from tests.backends.test_host_twins import CASES, INT32, garbage

pytestmark = pytest.mark.skipif(
    native.host_pass_runner() is None, reason="no C compiler: the numpy twins run alone"
)
GUARD = 16
"""Sentinel elements after the output: a write past it fails the test."""


def run_compiled(name: str, shape, inputs, params, start: np.ndarray) -> tuple[bool, np.ndarray]:
    """One twin through ``fp_host_pass``, over a buffer laid out as a host pass lays it:
    the inputs, then the output (starting as ``start``), then a guard."""
    op = get_op(name)
    packed = op.native.pack(**params)
    assert packed is not None, f"{name}: the packer declined valid parameters {params}"
    parts, offsets, at = [], [], 0
    for x in inputs:
        parts.append(x)
        offsets.append((at, x.shape[0]))
        at += x.shape[0]
    out_at = at
    guard = np.arange(GUARD, dtype=np.int32) - 7
    buf = np.concatenate([*parts, start.reshape(-1), guard]).astype(np.int32)
    record = np.zeros(native.TWIN_RECORD, dtype=np.int64)
    dims = (*shape, 1, 1)
    record[:5] = (
        native.twin_address(op.native.source, op.native.symbol),
        out_at,
        len(shape),
        *dims[:2],
    )
    for k, (offset, length) in enumerate(offsets):
        record[5 + 2 * k : 7 + 2 * k] = (offset, length)
    record[11 : 11 + len(packed)] = packed
    status = native.host_pass_runner()(buf.ctypes.data, record.ctypes.data, 1)
    numel = start.size
    np.testing.assert_array_equal(
        buf[out_at + numel :], guard, err_msg=f"{name} wrote past its output"
    )
    for (offset, length), x in zip(offsets, inputs):
        np.testing.assert_array_equal(buf[offset : offset + length], x, err_msg="an input changed")
    return status == 0, buf[out_at : out_at + numel].reshape(shape)


def test_every_host_twin_has_a_compiled_form():
    twins = {name for name, op in all_ops().items() if op.host is not None}
    assert twins == {name for name, op in all_ops().items() if op.native is not None}
    for op in all_ops().values():
        if op.native is not None:
            assert native.twin_address(op.native.source, op.native.symbol), op.name


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_twin_takes_valid_inputs_and_equals_numpy(name, data):
    shape, inputs, params = CASES[name](data.draw)
    start = garbage(shape, data.draw)
    expected = start.copy()
    get_op(name).host.fn(expected, *(x.copy() for x in inputs), **params)
    took, got = run_compiled(name, shape, inputs, params, start)
    assert took, f"{name} declined a valid case"
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_on_hostile_inputs_the_compiled_twin_equals_numpy_or_declines(name, data):
    shape, inputs, params = CASES[name](data.draw)
    inputs = tuple(
        np.array(data.draw(st.lists(INT32, max_size=12)), dtype=np.int32)
        if data.draw(st.booleans())
        else x
        for x in inputs
    )
    if data.draw(st.booleans()):  # an output one longer or shorter than the inputs imply
        shape = (*shape[:-1], max(shape[-1] + data.draw(st.sampled_from([-1, 1])), 0))
    start = garbage(shape, data.draw)
    expected = start.copy()
    try:
        with np.errstate(all="ignore"):
            get_op(name).host.fn(expected, *(x.copy() for x in inputs), **params)
        raised = None
    except Exception as exc:  # numpy refused: the compiled twin must have declined
        raised = exc
    took, got = run_compiled(name, shape, inputs, params, start)
    if took:
        assert raised is None, f"{name} took a case numpy refuses ({raised!r})"
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("clamp", {"lo": 2**31, "hi": None}),
        ("uniform_offsets", {"step": -(2**31) - 1}),
        ("causal_lengths", {"next_n": 0}),
        ("slot_pages", {"page_size": 0}),
        ("pages_per_request", {"page_size": True}),
        ("sparse_mla_split_plan", {"topk": -1, "block_n": 64}),
        ("paged_mqa_schedule", {"next_n": 1, "block_kv": 64, "num_sms": 0, "layout": "new"}),
    ],
)
def test_parameters_the_c_cannot_reproduce_are_declined_before_any_call(name, params):
    assert get_op(name).native.pack(**params) is None


def test_a_schedule_layout_numpy_does_not_name_is_packed_as_its_own_case():
    pack = get_op("paged_mqa_schedule").native.pack
    assert pack(next_n=1, block_kv=64, num_sms=8, layout="0.1.0")[-1] == 0
    assert pack(next_n=1, block_kv=64, num_sms=8, layout="new")[-1] == 1
    assert pack(next_n=1, block_kv=64, num_sms=8, layout="later")[-1] == 2


def test_the_runner_reports_the_first_declining_step():
    op = get_op("cumsum_with_zero")
    fn = native.twin_address(op.native.source, op.native.symbol)
    buf = np.zeros(8, dtype=np.int32)
    good = [fn, 4, 1, 3, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0]
    bad = [fn, 4, 1, 3, 1, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0]  # input one too long: declined
    records = np.array([good, bad, good], dtype=np.int64)
    assert native.host_pass_runner()(buf.ctypes.data, records.ctypes.data, 3) == 2
    assert native.library().fp_twin_record_size() == native.TWIN_RECORD  # twin.h's R_SIZE
