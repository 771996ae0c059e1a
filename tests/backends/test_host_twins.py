"""Every op's host twin writes exactly what its torch reference writes, on random inputs.

The twins run in eager plans instead of the device providers, so any difference
would be a plan that differs from a replayed one. Inputs include int32 overflow,
empty and padded batches, and the edge values each reference documents; outputs
start as garbage, so a twin that leaves an element unwritten fails
(:func:`planner.testing.check_provider`, which a plugin's tests run on its own ops).
Only this repository's ops are held to a case here: an installed plugin's ops, or a
test's, are tested where they are defined.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.flashinfer  # noqa: F401  (registers FlashInfer's ops)
import backends.nsa  # noqa: F401  (registers the NSA ops)
from planner.ops import HOST, MetadataOp, all_ops, get_op
from planner.testing import check_provider

I32 = np.int32
INT32 = st.integers(-(2**31), 2**31 - 1)
SMALL = st.integers(1, 5000)


def arr(draw, n: int, values=SMALL) -> np.ndarray:
    return np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=I32)


def indptr(draw, reqs: int, lo: int = 0) -> np.ndarray:
    lens = arr(draw, reqs, st.integers(lo, 40))
    return np.concatenate([[0], np.cumsum(lens)]).astype(I32)


def case_cumsum(draw):
    x = arr(draw, draw(st.integers(0, 40)), INT32)
    return (x.shape[0] + 1,), (x,), {}


def case_clamp(draw):
    x = arr(draw, draw(st.integers(0, 40)), INT32)
    bound = st.none() | st.integers(-3000, 3000)
    return x.shape, (x,), {"lo": draw(bound), "hi": draw(bound)}


def case_uniform(draw):
    return (draw(st.integers(0, 40)),), (), {"step": draw(st.integers(0, 2**31 - 1))}


def case_causal(draw):
    next_n = draw(st.integers(1, 4))
    seq = arr(draw, draw(st.integers(0, 12)), INT32)
    return (seq.shape[0] * next_n,), (seq,), {"next_n": next_n}


def _ragged(draw, with_seq: bool):
    reqs = draw(st.integers(0, 6))
    qo = indptr(draw, reqs, lo=1)
    tokens = int(qo[-1]) + draw(st.integers(-2 if qo[-1] >= 2 else 0, 5))
    seq = (qo[1:] - qo[:-1] + arr(draw, reqs, st.integers(0, 3000))).astype(I32)
    return tokens, qo, seq


def case_token_request(draw):
    tokens, qo, _ = _ragged(draw, False)
    return (tokens,), (qo,), {"pad": draw(st.integers(0, 7))}


def case_token_seq(draw):
    tokens, qo, seq = _ragged(draw, True)
    return (tokens,), (qo, seq), {}


def case_token_topk(draw):
    tokens, qo, seq = _ragged(draw, True)
    return (tokens,), (qo, seq), {"topk": draw(st.integers(1, 4096))}


def case_kv_ranges(draw):
    tokens, qo, seq = _ragged(draw, True)
    kv = np.concatenate([[0], np.cumsum(seq)]).astype(I32)
    return (2, tokens), (qo, kv), {}


def case_last_rows(draw):
    qo = indptr(draw, draw(st.integers(0, 8)), lo=1)
    return (qo.shape[0] - 1,), (qo,), {}


def case_slot_pages(draw):
    loc = arr(draw, draw(st.integers(0, 30)), st.integers(0, 2**31 - 1))
    return (2, loc.shape[0]), (loc,), {"page_size": draw(st.sampled_from([1, 16, 64, 100]))}


def case_per_request(draw):
    seq = arr(draw, draw(st.integers(0, 20)), st.integers(-(2**31) + 200, 2**31 - 200))
    return seq.shape, (seq,), {"page_size": draw(st.sampled_from([1, 16, 64, 100]))}


def case_schedule(draw):
    next_n = draw(st.integers(1, 2))
    reqs = draw(st.integers(1, 40))
    last = arr(draw, reqs, st.integers(next_n, 200_000))
    rows = np.stack([last - (next_n - 1 - i) for i in range(next_n)], axis=1).reshape(-1)
    sms = draw(st.sampled_from([1, 7, 78, 132]))
    layout = draw(st.sampled_from(["0.1.0", "new"]))
    params = {"next_n": next_n, "block_kv": 64, "num_sms": sms, "layout": layout}
    return (sms + 1, 2), (rows.astype(I32),), params


def case_split_plan(draw):
    rows = draw(st.integers(1, 10))  # plans always have a row
    splits = draw(st.integers(1, 9))
    lens = arr(draw, rows, st.integers(-5, 5000))
    params = {
        "topk": draw(st.sampled_from([0, 64, 2048, 2**30])),
        "block_n": draw(st.sampled_from([32, 64])),
    }
    return (rows * (splits + 1),), (lens,), params


CASES = {
    "cumsum_with_zero": case_cumsum,
    "clamp": case_clamp,
    "uniform_offsets": case_uniform,
    "causal_lengths": case_causal,
    "token_request": case_token_request,
    "token_positions": case_token_seq,
    "token_causal_lengths": case_token_seq,
    "token_topk_lengths": case_token_topk,
    "token_kv_ranges": case_kv_ranges,
    "last_token_rows": case_last_rows,
    "slot_pages": case_slot_pages,
    "pages_per_request": case_per_request,
    "last_page_len": case_per_request,
    "paged_mqa_schedule": case_schedule,
    "sparse_mla_split_plan": case_split_plan,
}


def in_tree(op: MetadataOp) -> bool:
    """Registered by this repository's ``backends`` (not by a plugin or a test)."""
    return op.providers["torch"].fn.__module__.split(".")[0] == "backends"


def test_every_in_tree_host_twin_has_a_case_here():
    twins = {name for name, op in all_ops().items() if op.host is not None and in_tree(op)}
    assert twins == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_host_twin_equals_the_torch_reference(name, data):
    shape, inputs, params = CASES[name](data.draw)
    tensors = [torch.from_numpy(x.copy()) for x in inputs]
    seed = data.draw(st.integers(0, 2**32 - 1))
    check_provider(get_op(name), HOST, [(shape, torch.int32)], tensors, params, seed=seed)


def test_the_host_twin_is_registered_by_name_and_never_chosen_for_a_device():
    op = get_op("cumsum_with_zero")
    assert op.providers[HOST].host and not op.providers[HOST].graph_safe
    assert HOST not in op.available_on(torch.device("cpu"))
    assert op.select(torch.device("cpu")).name == "torch"
