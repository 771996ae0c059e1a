"""FlashInfer backends on the CPU: the paged-KV metadata ops, references and Triton kernels.

Without CUDA the Triton kernels run under the interpreter, switched on before
``triton.language`` is first imported (see ``backends.kernels.generic_triton``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.flashinfer import kernels as tri  # noqa: E402
from backends.flashinfer import reference as ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32

needs_triton = pytest.mark.skipif(
    not tri.triton_usable(DEVICE), reason=f"Triton cannot run on {DEVICE}"
)
IMPLS = [pytest.param(ref, id="torch"), pytest.param(tri, id="triton", marks=needs_triton)]


def _t(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _garbage(n: int) -> torch.Tensor:
    return torch.full((n,), -7, dtype=I32, device=DEVICE)  # an unwritten element cannot pass as 0


# --- ops: hand-checked, and Triton equal to the reference ---------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_per_request_page_tables(impl):
    out = _garbage(5)
    impl.pages_per_request(out, _t([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 1, 2, 2, 3]
    impl.last_page_len(out, _t([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 16, 1, 16, 1]
    impl.last_page_len(out, _t([1, 2, 3, 4, 5]), 1)
    assert out.tolist() == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_kv_indices_example(impl):
    # page_size 4; request 0 (pool row 2) has 6 tokens = 2 pages, request 1 (row 1) 1 token.
    table = _t([[0] * 8, [40, 41, 42, 43, 44, 45, 46, 47], [12, 13, 14, 15, 28, 29, 30, 31]])
    indptr = _t([0, 2, 3])
    out = _garbage(2 * 3)  # capacity: 2 requests x 3 pages
    impl.paged_kv_indices(out, table, _t([2, 1], torch.int64), indptr, 4)
    assert out.tolist() == [3, 7, 10, 0, 0, 0]
    unit = _garbage(2 * 4)
    impl.paged_kv_indices(unit, table[:, :4], _t([1, 2]), _t([0, 3, 4]), 1)
    assert unit.tolist() == [40, 41, 42, 12, 0, 0, 0, 0]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    reqs=st.integers(1, 9),
    page_size=st.sampled_from([1, 2, 16, 64]),
    spare=st.integers(0, 3),
)
@needs_triton
def test_triton_kv_indices_equal_reference(seed, reqs, page_size, spare):
    g = torch.Generator().manual_seed(seed)
    ctx = int(torch.randint(1, 300, (1,), generator=g))
    lens = torch.randint(1, ctx + 1, (reqs,), generator=g, dtype=I32)
    counts = (lens + page_size - 1) // page_size
    width = int(counts.max()) + spare
    indptr = torch.zeros(reqs + 1, dtype=I32)
    indptr[1:] = counts.cumsum(0)
    table = torch.randint(0, 1 << 20, (reqs + 3, ctx), generator=g, dtype=I32)
    pool = torch.randint(0, reqs + 3, (reqs,), generator=g, dtype=torch.int64)
    args = (table.to(DEVICE), pool.to(DEVICE), indptr.to(DEVICE), page_size)
    expected, actual = _garbage(reqs * width), _garbage(reqs * width)
    ref.paged_kv_indices(expected, *args)
    tri.paged_kv_indices(actual, *args)
    assert torch.equal(expected.cpu(), actual.cpu())
    total = int(indptr[-1])
    assert not expected[total:].any()
    first = (table[pool[0], 0] // page_size).item()
    assert expected[0].item() == first


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 3, 64]))
@needs_triton
def test_triton_page_split_equals_reference(seed, page_size):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(
        -5, 1 << 20, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g, dtype=I32
    )
    for name in ("pages_per_request", "last_page_len"):
        expected, actual = _garbage(lens.shape[0]), _garbage(lens.shape[0])
        getattr(ref, name)(expected, lens.to(DEVICE), page_size)
        getattr(tri, name)(actual, lens.to(DEVICE), page_size)
        assert torch.equal(expected.cpu(), actual.cpu()), name
