"""The metadata kernels: references checked by hand and against a naive model, Triton
kernels checked bit for bit against the references.

Without CUDA the Triton kernels run under the interpreter. It is switched on before
anything here imports triton, so triton's own library functions are interpretable too;
only without CUDA, so that on a GPU machine the kernels (and everyone else's) are tested
compiled. If another module imported triton first the launchers still work, through the
scan kernel's interpreter twin; ``test_import_order_does_not_matter`` checks that order
in a fresh process, and ``scan_kernel`` runs the twin in this one.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.common import torch_ref as ref  # noqa: E402
from backends.common import triton_kernels as tri  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.support.kernels import DEVICE, I32, garbage, ints  # noqa: E402

IMPLS = [
    pytest.param(ref, id="torch"),
    pytest.param(tri, id="triton", marks=pytest.mark.triton(device=DEVICE)),
]


def _rand(gen: torch.Generator, lo: int, hi: int, *shape: int, dtype=I32) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=dtype).to(DEVICE)


def _both(name: str, shape: tuple[int, ...], *args) -> tuple[torch.Tensor, torch.Tensor]:
    expected, actual = garbage(*shape), garbage(*shape)
    assert getattr(ref, name)(expected, *args) is None
    assert getattr(tri, name)(actual, *args) is None
    return expected, actual


def _assert_same(expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert expected.dtype == actual.dtype == I32
    assert torch.equal(expected.cpu(), actual.cpu())


# --- hand-checked examples (both implementations) ----------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_cumsum_with_zero_examples(impl):
    out = garbage(6)
    impl.cumsum_with_zero(out, ints([3, 1, 4, 1, 5]))
    assert out.tolist() == [0, 3, 4, 8, 9, 14]
    out = garbage(2)
    impl.cumsum_with_zero(out, ints([-2]))
    assert out.tolist() == [0, -2]
    out = garbage(1)
    impl.cumsum_with_zero(out, ints([]))
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
    out = garbage(5)
    impl.clamp_into(out, ints([-5, 0, 5, 10, 7]), lo, hi)
    assert out.tolist() == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_uniform_offsets_examples(impl):
    out = garbage(5)
    impl.uniform_offsets(out, 3)
    assert out.tolist() == [0, 3, 6, 9, 12]
    out = garbage(3)
    impl.uniform_offsets(out, 0)
    assert out.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_token_slots_examples(impl, index_dtype):
    req_to_token = ints([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    pool = ints([2, 0, 2], dtype=index_dtype)
    seq_lens = ints([3, 1, 4])
    wide = garbage(3, 6)  # wider than ctx: columns 4 and 5 are never read
    impl.gather_token_slots(wide, req_to_token, pool, seq_lens)
    assert wide.tolist() == [
        [31, 32, 33, 0, 0, 0],
        [11, 0, 0, 0, 0, 0],
        [31, 32, 33, 34, 0, 0],
    ]
    narrow = garbage(3, 2)  # narrower than ctx and than some lengths: truncated
    impl.gather_token_slots(narrow, req_to_token, pool, seq_lens)
    assert narrow.tolist() == [[31, 32], [11, 0], [31, 32]]


@pytest.mark.parametrize("impl", IMPLS)
def test_page_table_from_slots_examples(impl):
    # page_size 4, width 7: pages start at columns 0 and 4; a third page column is
    # past the width and a zero (null) slot maps to the null page.
    slots = ints([[32, 33, 34, 35, 48, 49, 50], [0, 0, 0, 0, 0, 0, 0], [-1, 9, 9, 9, 7, 9, 9]])
    out = garbage(3, 3)
    impl.page_table_from_slots(out, slots, 4)
    assert out.tolist() == [[8, 12, 0], [0, 0, 0], [-1, 1, 0]]  # floor: -1 // 4 == -1
    short = garbage(3, 1)
    impl.page_table_from_slots(short, slots, 4)
    assert short.tolist() == [[8], [0], [-1]]
    unit = garbage(1, 4)
    impl.page_table_from_slots(unit, slots[:1, :3], 1)
    assert unit.tolist() == [[32, 33, 34, 0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_lengths_examples(impl):
    out = garbage(6)
    impl.causal_lengths(out, ints([10, 7]), 3)
    assert out.tolist() == [8, 9, 10, 5, 6, 7]
    out = garbage(2)
    impl.causal_lengths(out, ints([4, 9]), 1)
    assert out.tolist() == [4, 9]


@pytest.mark.parametrize("impl", IMPLS)
def test_contract_violations_are_refused(impl):
    x = ints([1, 2, 3])
    with pytest.raises(TypeError):
        impl.cumsum_with_zero(torch.zeros(4, dtype=torch.int64, device=DEVICE), x)
    with pytest.raises(ValueError):
        impl.cumsum_with_zero(garbage(3), x)
    with pytest.raises(ValueError):
        impl.clamp_into(garbage(3), x, 2**31, None)
    with pytest.raises(ValueError):
        impl.page_table_from_slots(garbage(1, 2), ints([[1, 2]]), 0)
    with pytest.raises(ValueError):
        impl.causal_lengths(garbage(6), x, 0)
    with pytest.raises(ValueError):
        impl.causal_lengths(garbage(5), x, 2)
    with pytest.raises(ValueError):
        impl.gather_token_slots(garbage(2, 4), ints([[1, 2, 3, 4]]), ints([0]), ints([1]))
    with pytest.raises(TypeError):
        impl.gather_token_slots(
            garbage(1, 4), ints([[1, 2, 3, 4]]), ints([0.0], torch.float32), ints([1])
        )
    with pytest.raises(ValueError):
        impl.uniform_offsets(garbage(4, 2)[:, 0], 1)  # strided
    with pytest.raises(ValueError):
        impl.clamp_into(garbage(4, 2)[:, 0], garbage(4, 2)[:, 1], 0, 1)


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
    out = garbage(len(x) + 1)
    ref.cumsum_with_zero(out, ints(x))
    assert out.tolist() == _naive("cumsum_with_zero", x)
    out = garbage(len(x))
    ref.clamp_into(out, ints(x), lo, hi)
    clamped = [max(v, lo) if lo is not None else v for v in x]
    assert out.tolist() == [min(v, hi) if hi is not None else v for v in clamped]
    ref.uniform_offsets(out, step)
    assert out.tolist() == [i * step for i in range(len(x))]


def _draw_sizes(data, *highs: int) -> list[int]:
    """One integer in [1, high] for each of ``highs``, drawn in order."""
    return [data.draw(st.integers(1, high)) for high in highs]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reference_2d_matches_naive_model(data):
    reqs, ctx, pool_size, width = _draw_sizes(data, 5, 12, 4, 16)
    table = data.draw(
        st.lists(
            st.lists(st.integers(0, 500), min_size=ctx, max_size=ctx),
            min_size=pool_size,
            max_size=pool_size,
        )
    )
    pool = data.draw(st.lists(st.integers(0, pool_size - 1), min_size=reqs, max_size=reqs))
    seq_lens = data.draw(st.lists(st.integers(1, ctx), min_size=reqs, max_size=reqs))
    out = garbage(reqs, width)
    ref.gather_token_slots(out, ints(table), ints(pool, torch.int64), ints(seq_lens))
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
    out = garbage(reqs, pages)
    ref.page_table_from_slots(out, ints(slots), page_size)
    assert out.tolist() == _naive("page_table_from_slots", slots, page_size, pages)

    next_n = data.draw(st.integers(1, 4))
    out = garbage(reqs * next_n)
    ref.causal_lengths(out, ints(seq_lens), next_n)
    assert out.tolist() == _naive("causal_lengths", seq_lens, next_n)


# --- Triton equals the reference, bit for bit --------------------------------------


@pytest.fixture(params=["stdlib", "interp_twin"])
def scan_kernel(request, monkeypatch):
    """Both cumsum kernels: the interpreter twin normally runs only when triton was
    imported before TRITON_INTERPRET was set, so force it here."""
    if request.param == "interp_twin":
        if DEVICE.type != "cpu":
            pytest.skip("the twin exists for the interpreter only")
        monkeypatch.setattr(tri, "_stdlib_interpretable", lambda: False)
    return request.param


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 1024, 1025, 4096, 4097, 12345])
def test_cumsum_with_zero_parity(scan_kernel, n):
    gen = torch.Generator().manual_seed(n)
    x = _rand(gen, -10_000, 10_000, n)
    _assert_same(*_both("cumsum_with_zero", (n + 1,), x))


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize("n", [1, 3, 1000, 1025])
@pytest.mark.parametrize(
    ("lo", "hi"), [(None, None), (-50, None), (None, 70), (-50, 70), (70, -50), (1, 1)]
)
def test_clamp_into_parity(n, lo, hi):
    gen = torch.Generator().manual_seed(n)
    x = _rand(gen, -100, 100, n)
    _assert_same(*_both("clamp_into", (n,), x, lo, hi))


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize("n", [1, 2, 5, 1024, 1025])
@pytest.mark.parametrize("step", [0, 1, 3, -2])
def test_uniform_offsets_parity(n, step):
    _assert_same(*_both("uniform_offsets", (n,), step))


@pytest.mark.triton(device=DEVICE)
def test_1d_kernels_parity_at_a_million(scan_kernel):
    n = 1_000_000
    x = _rand(torch.Generator().manual_seed(n), -10_000, 10_000, n)
    _assert_same(*_both("cumsum_with_zero", (n + 1,), x))
    if scan_kernel == "stdlib":  # the rest do not scan; once is enough
        _assert_same(*_both("clamp_into", (n,), x, -50, 70))
        _assert_same(*_both("uniform_offsets", (n,), 3))


GATHER_CASES = [
    # reqs, width, ctx, pool
    (1, 1, 1, 1),
    (1, 5, 3, 2),  # width > ctx
    (3, 7, 20, 4),  # width < ctx, lengths may exceed width
    (17, 1500, 1000, 20),  # several column blocks
    (64, 3000, 5000, 70),
    (300, 100, 100, 301),
    (2, 70_000, 70_000, 3),  # long rows
]


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize(("reqs", "width", "ctx", "pool"), GATHER_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_token_slots_parity(reqs, width, ctx, pool, index_dtype):
    gen = torch.Generator().manual_seed(reqs * 7919 + width)
    table = _rand(gen, 1, 2**31 - 1, pool, ctx)
    indices = _rand(gen, 0, pool, reqs, dtype=index_dtype)
    seq_lens = _rand(gen, 1, ctx + 1, reqs)
    seq_lens[0] = min(width, ctx)  # the edges: exactly full, and a single token
    seq_lens[-1] = 1
    _assert_same(*_both("gather_token_slots", (reqs, width), table, indices, seq_lens))


PAGE_CASES = [
    # reqs, width, page_size
    (1, 1, 1),
    (1, 7, 4),
    (5, 100, 1),
    (4, 1000, 3),
    (9, 1001, 16),  # not a multiple of the page size
    (33, 4097, 64),
    (2, 70_000, 1),
]


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize(("reqs", "width", "page_size"), PAGE_CASES)
@pytest.mark.parametrize("extra_pages", [-1, 0, 3])  # fewer, exactly, more pages than needed
def test_page_table_from_slots_parity(reqs, width, page_size, extra_pages):
    gen = torch.Generator().manual_seed(reqs * 31 + width + page_size)
    slots = _rand(gen, 0, 2**31 - 1, reqs, width)
    negative = _rand(gen, 0, 4, reqs, width) == 0  # a quarter, to pin down floor division
    slots = torch.where(negative, _rand(gen, -1000, 0, reqs, width), slots)
    slots[:, -1] = 0  # a null slot past the length
    pages = max(1, -(-width // page_size) + extra_pages)
    _assert_same(*_both("page_table_from_slots", (reqs, pages), slots, page_size))


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize("reqs", [1, 5, 300, 4096])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_causal_lengths_parity(reqs, next_n):
    gen = torch.Generator().manual_seed(reqs * 5 + next_n)
    seq_lens = _rand(gen, 1, 100_000, reqs)  # some below next_n: negative lengths, still exact
    _assert_same(*_both("causal_lengths", (reqs * next_n,), seq_lens, next_n))


@pytest.mark.triton(device=DEVICE)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_2d_kernels_parity_on_random_shapes(data):
    reqs, ctx, pool, width = _draw_sizes(data, 9, 300, 6, 1300)
    seed = data.draw(st.integers(0, 2**32 - 1))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    gen = torch.Generator().manual_seed(seed)
    table = _rand(gen, 0, 10**6, pool, ctx)
    indices = _rand(gen, 0, pool, reqs, dtype=dtype)
    seq_lens = _rand(gen, 1, ctx + 1, reqs)
    expected, actual = _both("gather_token_slots", (reqs, width), table, indices, seq_lens)
    _assert_same(expected, actual)

    page_size = data.draw(st.integers(1, 70))
    pages = data.draw(st.integers(1, width // page_size + 3))
    _assert_same(*_both("page_table_from_slots", (reqs, pages), expected, page_size))

    next_n = data.draw(st.integers(1, 4))
    _assert_same(*_both("causal_lengths", (reqs * next_n,), seq_lens, next_n))


@pytest.mark.triton(device=DEVICE)
def test_import_order_does_not_matter():
    """Another test module may import triton, or this package, before anything sets
    TRITON_INTERPRET; the launchers must still run under the interpreter then."""
    script = textwrap.dedent(
        """
        import os
        import torch
        import triton.language
        from backends.common import torch_ref as ref, triton_kernels as tri
        os.environ["TRITON_INTERPRET"] = "1"
        assert tri.triton_available(torch.device("cpu"))
        assert not tri._stdlib_interpretable()
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-9, 9, (5000,), generator=g, dtype=torch.int32)
        table = torch.randint(0, 99, (3, 40), generator=g, dtype=torch.int32)
        idx = torch.tensor([2, 0], dtype=torch.int64)
        lens = torch.tensor([40, 3], dtype=torch.int32)
        calls = [
            ("cumsum_with_zero", (5001,), (x,)),
            ("clamp_into", (5000,), (x, -3, 4)),
            ("uniform_offsets", (7,), (5,)),
            ("gather_token_slots", (2, 50), (table, idx, lens)),
            ("page_table_from_slots", (3, 7), (table, 6)),
            ("causal_lengths", (6,), (lens, 3)),
        ]
        for name, shape, args in calls:
            a, b = torch.full(shape, -7, dtype=torch.int32), torch.full(shape, -7, dtype=torch.int32)
            getattr(ref, name)(a, *args)
            getattr(tri, name)(b, *args)
            assert torch.equal(a, b), name
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", IMPLS)
def test_capturable_in_a_cuda_graph(impl):
    """Capture proves no host sync and no allocation of the outputs; replay after
    changing the inputs in place proves the graph reads them, not stale values."""
    dev = torch.device("cuda")
    x = torch.tensor([3, 1, 4, 1, 5], dtype=I32, device=dev)
    table = torch.arange(1, 25, dtype=I32, device=dev).view(3, 8)
    idx = torch.tensor([2, 0], dtype=torch.int64, device=dev)
    lens = torch.tensor([5, 2], dtype=I32, device=dev)
    outs = {
        "cumsum": torch.empty(6, dtype=I32, device=dev),
        "clamp": torch.empty(5, dtype=I32, device=dev),
        "offsets": torch.empty(3, dtype=I32, device=dev),
        "slots": torch.empty(2, 10, dtype=I32, device=dev),
        "pages": torch.empty(2, 4, dtype=I32, device=dev),
        "causal": torch.empty(4, dtype=I32, device=dev),
    }

    def step():
        impl.cumsum_with_zero(outs["cumsum"], x)
        impl.clamp_into(outs["clamp"], x, 2, 4)
        impl.uniform_offsets(outs["offsets"], 2)
        impl.gather_token_slots(outs["slots"], table, idx, lens)
        impl.page_table_from_slots(outs["pages"], outs["slots"], 3)
        impl.causal_lengths(outs["causal"], lens, 2)

    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.tensor([1, 1, 1, 1, 1], dtype=I32))
    lens.copy_(torch.tensor([1, 6], dtype=I32))
    graph.replay()
    torch.cuda.synchronize()
    assert outs["cumsum"].tolist() == [0, 1, 2, 3, 4, 5]
    assert outs["clamp"].tolist() == [2, 2, 2, 2, 2]
    assert outs["offsets"].tolist() == [0, 2, 4]
    assert outs["slots"].tolist() == [[17] + [0] * 9, [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]]
    assert outs["pages"].tolist() == [[5, 0, 0, 0], [0, 1, 0, 0]]
    assert outs["causal"].tolist() == [0, 1, 5, 6]
