"""The token table's fused Triton launch against the two torch references run one after the
other, bit for bit, on random tables, lengths, widths and page sizes (the interpreter runs
it without CUDA; compiled on a GPU machine)."""

from __future__ import annotations

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.common import torch_ref as ref  # noqa: E402
from backends.common import triton_kernels as tri  # noqa: E402
from backends.common.token_table_triton import token_table  # noqa: E402
from tests.support.kernels import DEVICE, garbage, ints  # noqa: E402

pytestmark = pytest.mark.skipif(
    not tri.triton_available(DEVICE), reason=f"Triton cannot run on {DEVICE} here"
)


def _both(table, pool, seq_lens, width: int, pages: int, page_size: int):
    """(fused, references): slots and page table each."""
    reqs = pool.shape[0]
    slots, page = garbage(reqs, width), garbage(reqs, pages)
    token_table((slots, page), ((table, pool, seq_lens), (slots,)), ({}, {"page_size": page_size}))
    want_slots, want_page = garbage(reqs, width), garbage(reqs, pages)
    ref.gather_token_slots(want_slots, table, pool, seq_lens)
    ref.page_table_from_slots(want_page, want_slots, page_size)
    return (slots, page), (want_slots, want_page)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_fused_equals_the_references_run_in_turn(data):
    reqs = data.draw(st.integers(1, 6))
    ctx = data.draw(st.integers(1, 300))
    pool_size = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(0, 320))
    page_size = data.draw(st.integers(1, 70))
    pages = data.draw(st.integers(0, 12))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    high = data.draw(st.sampled_from([1000, 10**6]))  # small: negative slots at page starts
    table = torch.randint(-100, high, (pool_size, ctx), generator=gen, dtype=torch.int32)
    pool = torch.randint(0, pool_size, (reqs,), generator=gen)
    pool = pool.to(data.draw(st.sampled_from([torch.int32, torch.int64])))
    seq_lens = torch.randint(1, ctx + 1, (reqs,), generator=gen, dtype=torch.int32)
    got, want = _both(
        table.to(DEVICE), pool.to(DEVICE), seq_lens.to(DEVICE), width, pages, page_size
    )
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_decode_shapes_of_an_nsa_plan():
    """64-token pages, a table wider than the widest request, pages past the width."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 1 << 20, (9, 4096), generator=gen, dtype=torch.int32)
    pool = torch.tensor([8, 0, 3, 3], dtype=torch.int64)
    seq_lens = torch.tensor([1, 4096, 65, 2000], dtype=torch.int32)
    got, want = _both(table.to(DEVICE), pool.to(DEVICE), seq_lens.to(DEVICE), 4096, 64, 64)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_refuses_a_page_table_that_reads_other_slots():
    table, pool, lens = ints([[1, 2, 3, 4]]), ints([0]), ints([2])
    slots, other, page = garbage(1, 4), garbage(1, 4), garbage(1, 1)
    with pytest.raises(ValueError, match="slots this launch writes"):
        token_table((slots, page), ((table, pool, lens), (other,)), ({}, {"page_size": 4}))


def test_keeps_the_references_checks():
    table, pool, lens = ints([[1, 2, 3, 4]]), ints([0, 0]), ints([2])
    slots, page = garbage(2, 4), garbage(2, 1)
    with pytest.raises(ValueError):  # two rows out, one length
        token_table((slots, page), ((table, pool, lens), (slots,)), ({}, {"page_size": 4}))
    slots = garbage(1, 4)
    with pytest.raises(ValueError):  # page size 0
        token_table((slots, page[:1]), ((table, ints([0]), lens), (slots,)), ({}, {"page_size": 0}))


def _inputs():
    table = torch.arange(40, dtype=torch.int32, device=DEVICE).view(2, 20)
    return {
        "slots": garbage(3, 20),
        "pages": garbage(3, 5),
        "table": table,
        "pool": ints([1, 0, 1], torch.int64),
        "lens": ints([20, 3, 7]),
        "page_size": 4,
    }


BAD = {
    "slots int64": ("slots", lambda t: t.to(torch.int64)),
    "pages int64": ("pages", lambda t: t.to(torch.int64)),
    "table int64": ("table", lambda t: t.to(torch.int64)),
    "lens int64": ("lens", lambda t: t.to(torch.int64)),
    "pool float": ("pool", lambda t: t.to(torch.float32)),
    "slots 1-D": ("slots", lambda t: t.reshape(-1)),
    "pages 3-D": ("pages", lambda t: t.unsqueeze(0)),
    "table 1-D": ("table", lambda t: t.reshape(-1)),
    "lens 2-D": ("lens", lambda t: t.unsqueeze(1)),
    "pool 2-D": ("pool", lambda t: t.unsqueeze(1)),
    "table strided": ("table", lambda t: t[:, ::2]),
    "lens strided": ("lens", lambda t: torch.stack([t, t], 1)[:, 0]),
    "pool strided": ("pool", lambda t: torch.stack([t, t], 1)[:, 0]),
    "pages strided": ("pages", lambda t: garbage(3, 10)[:, ::2]),
    "pool short": ("pool", lambda t: t[:2]),
    "lens long": ("lens", lambda t: ints([1, 2, 3, 4])),
    "pages rows": ("pages", lambda t: garbage(2, 5)),
    "page size 0": ("page_size", lambda v: 0),
    "page size bool": ("page_size", lambda v: True),
    "page size float": ("page_size", lambda v: 4.0),
    "page size 2**31": ("page_size", lambda v: 2**31),
}


def _call(fn_inputs, fused: bool):
    x = fn_inputs
    if fused:
        args = ((x["table"], x["pool"], x["lens"]), (x["slots"],))
        token_table((x["slots"], x["pages"]), args, ({}, {"page_size": x["page_size"]}))
    else:
        ref.gather_token_slots(x["slots"], x["table"], x["pool"], x["lens"])
        ref.page_table_from_slots(x["pages"], x["slots"], x["page_size"])


@pytest.mark.parametrize("case", list(BAD))
def test_refuses_exactly_what_the_references_refuse(case):
    """The fused launch's one-pass acceptance must never let through what either reference
    check refuses: each bad input raises the references' own error."""
    name, spoil = BAD[case]
    x = _inputs()
    x[name] = spoil(x[name])
    with pytest.raises((TypeError, ValueError)) as want:
        _call(dict(x), fused=False)
    with pytest.raises(want.type, match=re.escape(str(want.value))):
        _call(dict(x), fused=True)
