"""Length-aware row top-k: the reference against hand-worked rows and ``torch.topk``,
the Triton kernel bit for bit against the reference (interpreter here, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.common.triton_kernels import triton_available
from backends.nsa.topk import row_topk, row_topk_provider
from backends.nsa.topk_ref import order_keys, reference_row_topk
from backends.nsa.topk_triton import row_topk_triton
from planner.errors import PlanError

I32 = torch.int32
NAN, INF = float("nan"), float("inf")
needs_triton = pytest.mark.skipif(
    not triton_available(torch.device("cpu")), reason="no interpreter"
)


def ref(rows: list[list[float]], lengths: list[int], k: int) -> list[list[int]]:
    x = torch.tensor(rows, dtype=torch.float32)
    return reference_row_topk(x, torch.tensor(lengths, dtype=I32), k).tolist()


def random_case(
    gen: torch.Generator, rows: int, width: int, kind: str, device: str = "cpu"
) -> torch.Tensor:
    """Scores of one flavour, in a strided view (row stride > width, like deep_gemm's)."""
    shape = (rows, width + 5)
    if kind == "distinct":
        x = torch.randperm(rows * shape[1], generator=gen).float().view(shape) - 100.0
    elif kind == "ties":
        x = torch.randint(-2, 3, shape, generator=gen).float()
    elif kind == "nasty":  # NaN, -inf, signed zeros, a few finite values
        choice = torch.randint(0, 6, shape, generator=gen)
        vals = torch.tensor([NAN, -INF, -0.0, 0.0, 1.5, -2.0])
        x = vals[choice]
    else:
        x = torch.randn(shape, generator=gen)
    return x.to(device)[:, :width]


# --------------------------------------------------------------------- reference


def test_reference_rules_by_hand() -> None:
    # Best 2 of 5: 9 at 3 and 7 at 0; output ascending.
    assert ref([[7.0, 1.0, 2.0, 9.0, 3.0]], [5], 2) == [[0, 3]]
    # Ties at the threshold go to the lowest positions.
    assert ref([[1.0, 5.0, 5.0, 5.0, 0.0]], [5], 2) == [[1, 2]]
    # -0.0 and +0.0 tie: lowest position wins either way round.
    assert ref([[-1.0, 0.0, -0.0, -2.0]], [4], 1) == [[1]]
    assert ref([[-1.0, -0.0, 0.0, -2.0]], [4], 1) == [[1]]
    # Positions at or past the length are never chosen, whatever their score.
    assert ref([[1.0, 2.0, 3.0, 100.0, 200.0]], [3], 2) == [[1, 2]]
    # NaN is never chosen; -inf is an ordinary (lowest) score.
    assert ref([[NAN, -INF, NAN, 1.0, NAN]], [5], 3) == [[1, 3, -1]]
    # A row that fits in k takes all its positions without scoring (NaN too).
    assert ref([[NAN, 1.0, 2.0, 3.0]], [2], 3) == [[0, 1, -1]]
    # Lengths clamp to [0, width]; k may exceed the width.
    assert ref([[1.0, 2.0], [3.0, 4.0]], [-4, 9], 3) == [[-1, -1, -1], [0, 1, -1]]
    assert reference_row_topk(torch.empty(2, 0), torch.tensor([0, 3], dtype=I32), 2).tolist() == [
        [-1, -1],
        [-1, -1],
    ]


def test_order_keys_order_like_floats() -> None:
    vals = torch.tensor([-INF, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, INF])
    keys = order_keys(vals)
    assert keys.tolist() == sorted(keys.tolist())
    assert keys[3] == keys[4]  # signed zeros tie
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32


def test_reference_matches_torch_topk_sets_on_distinct_scores() -> None:
    gen = torch.Generator().manual_seed(1)
    for width, k in ((64, 8), (300, 40), (50, 50), (20, 64)):
        x = random_case(gen, 6, width, "distinct")
        lengths = torch.randint(0, width + 1, (6,), generator=gen, dtype=I32)
        got = reference_row_topk(x, lengths, k)
        for r in range(6):
            n = int(lengths[r])
            want = torch.topk(x[r, :n], min(k, n)).indices.sort().values.tolist()
            assert got[r].tolist() == want + [-1] * (k - len(want))


def test_reference_has_no_host_sync_and_static_shapes() -> None:
    """Same op sequence and shapes for different data: what CUDA graph capture needs."""

    class Trace(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
            self.ops.append((func.__name__, shape))
            return out

    traces = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        x = random_case(gen, 4, 40, "ties")
        lengths = torch.randint(0, 41, (4,), generator=gen, dtype=I32)
        with Trace() as t:
            reference_row_topk(x, lengths, 7, torch.empty(4, 7, dtype=I32))
        traces.append(t.ops)
    assert traces[0] == traces[1]
    bad = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")
    assert not [op for op, _ in traces[0] if any(b in op for b in bad)]


def test_checks_name_the_field() -> None:
    x, lengths, out = torch.zeros(2, 8), torch.zeros(2, dtype=I32), torch.empty(2, 3, dtype=I32)
    with pytest.raises(PlanError, match=r"\[logits\]"):
        reference_row_topk(x.double(), lengths, 3, out)
    with pytest.raises(PlanError, match=r"\[logits\]"):
        reference_row_topk(torch.zeros(8, 2).t(), lengths, 3, out)
    with pytest.raises(PlanError, match=r"\[lengths\]"):
        reference_row_topk(x, lengths.long(), 3, out)
    with pytest.raises(PlanError, match=r"\[k\]"):
        reference_row_topk(x, lengths, 0, torch.empty(2, 0, dtype=I32))
    with pytest.raises(PlanError, match=r"\[out\]"):
        reference_row_topk(x, lengths, 4, out)


# ------------------------------------------------------------------------ triton


def check_triton(x: torch.Tensor, lengths: torch.Tensor, k: int, **kw) -> None:
    want = reference_row_topk(x, lengths, k)
    got = torch.full_like(want, 12345)  # poison: every entry must be written
    row_topk_triton(x, lengths, k, got, **kw)
    assert torch.equal(got, want), (lengths.tolist(), k, got, want)


@needs_triton
@pytest.mark.parametrize("kind", ["distinct", "ties", "nasty", "normal"])
def test_triton_matches_reference_bit_for_bit(kind: str) -> None:
    gen = torch.Generator().manual_seed(["distinct", "ties", "nasty", "normal"].index(kind))
    for width, k in ((0, 3), (1, 1), (37, 1), (90, 7), (130, 64), (60, 60), (40, 61), (200, 17)):
        rows = 3
        x = random_case(gen, rows, width, kind)
        lengths = torch.randint(-1, width + 3, (rows,), generator=gen, dtype=I32)
        lengths[0] = width  # always one full row
        check_triton(x, lengths, k, block=64)


@needs_triton
def test_triton_edge_rows() -> None:
    # Every length 0..width in one batch; block smaller than k and than the row.
    x = torch.randint(-3, 4, (33, 32)).float()
    check_triton(x, torch.arange(33, dtype=I32), 5, block=16)
    # All scores equal: the k lowest positions.
    check_triton(torch.ones(2, 50), torch.tensor([50, 30], dtype=I32), 9, block=16)
    # Mostly NaN (fewer candidates than k), all NaN, all -inf.
    x = torch.full((3, 40), NAN)
    x[0, ::10] = 1.0
    x[2] = -INF
    check_triton(x, torch.tensor([40, 40, 40], dtype=I32), 6, block=16)
    # Only the lowest bit separates the threshold from the next key.
    base = torch.tensor(1.0)
    nxt = torch.nextafter(base, torch.tensor(2.0))
    x = torch.stack([base, nxt, base, nxt, base]).repeat(2, 4)
    check_triton(x, torch.tensor([20, 13], dtype=I32), 7, block=16)


def test_row_topk_dispatch_on_cpu_is_the_reference() -> None:
    assert row_topk_provider(torch.device("cpu")) == "torch"
    x = torch.randn(3, 20)
    lengths = torch.tensor([20, 5, 0], dtype=I32)
    out = torch.empty(3, 6, dtype=I32)
    assert row_topk(x, lengths, 6, out) is out
    assert torch.equal(out, reference_row_topk(x, lengths, 6))


# --------------------------------------------------------------------------- gpu


@pytest.mark.gpu
def test_triton_compiled_matches_reference_on_cuda() -> None:
    assert row_topk_provider(torch.device("cuda")) == "triton"
    gen = torch.Generator().manual_seed(7)
    for kind in ("distinct", "ties", "nasty", "normal"):
        for width, k, rows in ((4096, 2048, 64), (16384, 2048, 128), (300, 512, 5), (1000, 1, 3)):
            x = random_case(gen, rows, width, kind, "cuda")
            lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=I32).cuda()
            want = reference_row_topk(x, lengths, k)
            got = torch.full_like(want, 12345)
            row_topk(x, lengths, k, got)
            assert torch.equal(got, want), (kind, width, k)


@pytest.mark.gpu
def test_triton_topk_replays_in_a_cuda_graph() -> None:
    x = torch.randn(16, 4096, device="cuda")
    lengths = torch.randint(0, 4097, (16,), dtype=I32, device="cuda")
    out = torch.empty(16, 2048, dtype=I32, device="cuda")
    row_topk(x, lengths, 2048, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_topk(x, lengths, 2048, out)
    x.copy_(torch.randn_like(x))
    lengths.copy_(torch.randint(0, 4097, (16,), dtype=I32, device="cuda"))
    graph.replay()
    assert torch.equal(out, reference_row_topk(x, lengths, 2048))
