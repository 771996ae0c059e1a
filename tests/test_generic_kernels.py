"""The metadata kernels: references checked by hand and against a naive model, Triton
kernels checked bit for bit against the references.

Without CUDA the Triton kernels run under the interpreter, which has to be switched on
before ``triton.language`` is first imported (see ``generic_triton``'s docstring), hence
the environment line ahead of the imports.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.kernels import generic_torch as ref  # noqa: E402
from backends.kernels import generic_triton as tri  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32

needs_triton = pytest.mark.skipif(
    not tri.triton_available(DEVICE), reason=f"Triton cannot run on {DEVICE} here"
)
IMPLS = [
    pytest.param(ref, id="torch"),
    pytest.param(tri, id="triton", marks=needs_triton),
]


def _t(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _garbage(*shape: int) -> torch.Tensor:
    # Pre-filled so an element a kernel forgets to write cannot pass as a zero.
    return torch.full(shape, -7, dtype=I32, device=DEVICE)


def _rand(gen: torch.Generator, lo: int, hi: int, *shape: int, dtype=I32) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=dtype).to(DEVICE)


def _both(name: str, shape: tuple[int, ...], *args) -> tuple[torch.Tensor, torch.Tensor]:
    expected, actual = _garbage(*shape), _garbage(*shape)
    assert getattr(ref, name)(expected, *args) is None
    assert getattr(tri, name)(actual, *args) is None
    return expected, actual


def _assert_same(expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert expected.dtype == actual.dtype == I32
    assert torch.equal(expected.cpu(), actual.cpu())


# --- hand-checked examples (both implementations) ----------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_cumsum_with_zero_examples(impl):
    out = _garbage(6)
    impl.cumsum_with_zero(out, _t([3, 1, 4, 1, 5]))
    assert out.tolist() == [0, 3, 4, 8, 9, 14]
    out = _garbage(2)
    impl.cumsum_with_zero(out, _t([-2]))
    assert out.tolist() == [0, -2]
    out = _garbage(1)
    impl.cumsum_with_zero(out, _t([]))
    assert out.tolist() == [0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        (0, 6, [0, 0, 5, 6, 6]),
        (1, None, [1, 1, 5, 10, 7]),
        (None, 4, [-5, 0, 4, 4, 4]),
        (None, None, [-5, 0, 5, 10, 7]),
        (6, 2, [2, 2, 2, 2, 2]),  # lo > hi gives hi, as torch.clamp does
    ],
)
def test_clamp_into_examples(impl, lo, hi, expected):
    out = _garbage(5)
    impl.clamp_into(out, _t([-5, 0, 5, 10, 7]), lo, hi)
    assert out.tolist() == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_uniform_offsets_examples(impl):
    out = _garbage(5)
    impl.uniform_offsets(out, 3)
    assert out.tolist() == [0, 3, 6, 9, 12]
    out = _garbage(3)
    impl.uniform_offsets(out, 0)
    assert out.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_token_slots_examples(impl, index_dtype):
    req_to_token = _t([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    pool = _t([2, 0, 2], dtype=index_dtype)
    seq_lens = _t([3, 1, 4])
    wide = _garbage(3, 6)  # wider than ctx: columns 4 and 5 are never read
    impl.gather_token_slots(wide, req_to_token, pool, seq_lens)
    assert wide.tolist() == [
        [31, 32, 33, 0, 0, 0],
        [11, 0, 0, 0, 0, 0],
        [31, 32, 33, 34, 0, 0],
    ]
    narrow = _garbage(3, 2)  # narrower than ctx and than some lengths: truncated
    impl.gather_token_slots(narrow, req_to_token, pool, seq_lens)
    assert narrow.tolist() == [[31, 32], [11, 0], [31, 32]]


@pytest.mark.parametrize("impl", IMPLS)
def test_page_table_from_slots_examples(impl):
    # page_size 4, width 7: pages start at columns 0 and 4; a third page column is
    # past the width and a zero (null) slot maps to the null page.
    slots = _t([[32, 33, 34, 35, 48, 49, 50], [0, 0, 0, 0, 0, 0, 0], [-1, 9, 9, 9, 7, 9, 9]])
    out = _garbage(3, 3)
    impl.page_table_from_slots(out, slots, 4)
    assert out.tolist() == [[8, 12, 0], [0, 0, 0], [-1, 1, 0]]  # floor: -1 // 4 == -1
    short = _garbage(3, 1)
    impl.page_table_from_slots(short, slots, 4)
    assert short.tolist() == [[8], [0], [-1]]
    unit = _garbage(1, 4)
    impl.page_table_from_slots(unit, slots[:1, :3], 1)
    assert unit.tolist() == [[32, 33, 34, 0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_lengths_examples(impl):
    out = _garbage(6)
    impl.causal_lengths(out, _t([10, 7]), 3)
    assert out.tolist() == [8, 9, 10, 5, 6, 7]
    out = _garbage(2)
    impl.causal_lengths(out, _t([4, 9]), 1)
    assert out.tolist() == [4, 9]


@pytest.mark.parametrize("impl", IMPLS)
def test_contract_violations_are_refused(impl):
    x = _t([1, 2, 3])
    with pytest.raises(TypeError):
        impl.cumsum_with_zero(torch.zeros(4, dtype=torch.int64, device=DEVICE), x)
    with pytest.raises(ValueError):
        impl.cumsum_with_zero(_garbage(3), x)
    with pytest.raises(ValueError):
        impl.clamp_into(_garbage(3), x, 2**31, None)
    with pytest.raises(ValueError):
        impl.page_table_from_slots(_garbage(1, 2), _t([[1, 2]]), 0)
    with pytest.raises(ValueError):
        impl.causal_lengths(_garbage(6), x, 0)
    with pytest.raises(ValueError):
        impl.causal_lengths(_garbage(5), x, 2)
    with pytest.raises(ValueError):
        impl.gather_token_slots(_garbage(2, 4), _t([[1, 2, 3, 4]]), _t([0]), _t([1]))
    with pytest.raises(TypeError):
        impl.gather_token_slots(
            _garbage(1, 4), _t([[1, 2, 3, 4]]), _t([0.0], torch.float32), _t([1])
        )
    with pytest.raises(ValueError):
        impl.uniform_offsets(_garbage(4, 2)[:, 0], 1)  # strided
    with pytest.raises(ValueError):
        impl.clamp_into(_garbage(4, 2)[:, 0], _garbage(4, 2)[:, 1], 0, 1)


# --- references against a naive model of the spec ---------------------------------


def _naive(name: str, *args) -> list:
    if name == "cumsum_with_zero":
        (x,) = args
        acc = [0]
        for v in x:
            acc.append(acc[-1] + v)
        return acc
    if name == "gather_token_slots":
        table, pool, seq_lens, width = args
        ctx = len(table[0])
        return [
            [table[p][j] if j < min(s, ctx) else 0 for j in range(width)]
            for p, s in zip(pool, seq_lens, strict=True)
        ]
    if name == "page_table_from_slots":
        slots, page_size, pages = args
        return [
            [
                row[p * page_size] // page_size if p * page_size < len(row) else 0
                for p in range(pages)
            ]
            for row in slots
        ]
    if name == "causal_lengths":
        seq_lens, next_n = args
        return [s - (next_n - 1 - i) for s in seq_lens for i in range(next_n)]
    raise AssertionError(name)


@settings(max_examples=60, deadline=None)
@given(
    x=st.lists(st.integers(-(10**6), 10**6), max_size=40),
    lo=st.none() | st.integers(-100, 100),
    hi=st.none() | st.integers(-100, 100),
    step=st.integers(-1000, 1000),
)
def test_reference_1d_matches_naive_model(x, lo, hi, step):
    out = _garbage(len(x) + 1)
    ref.cumsum_with_zero(out, _t(x))
    assert out.tolist() == _naive("cumsum_with_zero", x)
    out = _garbage(len(x))
    ref.clamp_into(out, _t(x), lo, hi)
    clamped = [max(v, lo) if lo is not None else v for v in x]
    assert out.tolist() == [min(v, hi) if hi is not None else v for v in clamped]
    ref.uniform_offsets(out, step)
    assert out.tolist() == [i * step for i in range(len(x))]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reference_2d_matches_naive_model(data):
    reqs = data.draw(st.integers(1, 5))
    ctx = data.draw(st.integers(1, 12))
    pool_size = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 16))
    table = data.draw(
        st.lists(
            st.lists(st.integers(0, 500), min_size=ctx, max_size=ctx),
            min_size=pool_size,
            max_size=pool_size,
        )
    )
    pool = data.draw(st.lists(st.integers(0, pool_size - 1), min_size=reqs, max_size=reqs))
    seq_lens = data.draw(st.lists(st.integers(1, ctx), min_size=reqs, max_size=reqs))
    out = _garbage(reqs, width)
    ref.gather_token_slots(out, _t(table), _t(pool, torch.int64), _t(seq_lens))
    assert out.tolist() == _naive("gather_token_slots", table, pool, seq_lens, width)

    page_size = data.draw(st.integers(1, 5))
    pages = data.draw(st.integers(1, 8))
    slots = data.draw(
        st.lists(
            st.lists(st.integers(-20, 500), min_size=width, max_size=width),
            min_size=reqs,
            max_size=reqs,
        )
    )
    out = _garbage(reqs, pages)
    ref.page_table_from_slots(out, _t(slots), page_size)
    assert out.tolist() == _naive("page_table_from_slots", slots, page_size, pages)

    next_n = data.draw(st.integers(1, 4))
    out = _garbage(reqs * next_n)
    ref.causal_lengths(out, _t(seq_lens), next_n)
    assert out.tolist() == _naive("causal_lengths", seq_lens, next_n)
