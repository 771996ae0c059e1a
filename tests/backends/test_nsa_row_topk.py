"""Length-aware row top-k: the reference against hand-worked rows and ``torch.topk``,
the Triton kernel bit for bit against the reference (interpreter here, compiled on GPU),
with and without the fused position-to-slot mapping the decode indexer uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from backends.common.triton_kernels import triton_available
from backends.nsa import topk as topk_module
from backends.nsa.topk import row_topk, row_topk_provider
from backends.nsa.topk_ref import map_positions_to_slots, order_keys, reference_row_topk
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


def random_slots(gen: torch.Generator, reqs: int, width: int, device: str = "cpu") -> torch.Tensor:
    """A slot table like the plan's: int32, random values, row stride past its width."""
    table = torch.randint(-(2**31), 2**31 - 1, (reqs, width + 7), generator=gen, dtype=I32)
    return table.to(device)[:, :width]


def mapped_reference(
    x: torch.Tensor, lengths: torch.Tensor, k: int, slots: torch.Tensor, next_n: int
) -> torch.Tensor:
    return map_positions_to_slots(reference_row_topk(x, lengths, k), slots, next_n)


class Trace(TorchDispatchMode):
    """Records each op and its output shape: equal traces for different data mean static
    shapes and no data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        self.ops.append((func.__name__, shape))
        return out


SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")


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

    traces = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        x = random_case(gen, 4, 40, "ties")
        lengths = torch.randint(0, 41, (4,), generator=gen, dtype=I32)
        with Trace() as t:
            reference_row_topk(x, lengths, 7, torch.empty(4, 7, dtype=I32))
        traces.append(t.ops)
    assert traces[0] == traces[1]
    assert not [op for op, _ in traces[0] if any(b in op for b in SYNCING_OPS)]


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


def test_slot_mapping_by_hand() -> None:
    # Rows 0-1 are request 0, rows 2-3 request 1; -1 stays -1 whatever slot 0 holds.
    idx = torch.tensor([[0, 2, -1], [1, -1, -1], [0, 1, 2], [-1, -1, -1]], dtype=I32)
    table = torch.tensor([[10, 11, 12, 99], [20, 21, 22, 99]], dtype=I32)
    assert map_positions_to_slots(idx, table, 2).tolist() == [
        [10, 12, -1],
        [11, -1, -1],
        [20, 21, 22],
        [-1, -1, -1],
    ]
    # Positions past the table's width read its last column (the clamp), not out of bounds.
    narrow = table[:, :2]
    assert map_positions_to_slots(idx, narrow, 2).tolist()[2] == [20, 21, 21]


def test_row_topk_with_slots_on_cpu_is_reference_then_mapping() -> None:
    gen = torch.Generator().manual_seed(3)
    x = random_case(gen, 6, 30, "ties")
    lengths = torch.tensor([30, 4, 0, 17, 31, -2], dtype=I32)
    slots = random_slots(gen, 2, 30)
    out = torch.full((6, 8), 12345, dtype=I32)
    assert row_topk(x, lengths, 8, out, slots=slots, next_n=3) is out
    assert torch.equal(out, mapped_reference(x, lengths, 8, slots, 3))
    # Without slots: positions, exactly as before.
    assert torch.equal(row_topk(x, lengths, 8, out), reference_row_topk(x, lengths, 8))


def test_slot_mapping_has_no_host_sync_and_static_shapes() -> None:
    traces = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        x = random_case(gen, 4, 40, "ties")
        lengths = torch.randint(0, 41, (4,), generator=gen, dtype=I32)
        slots = random_slots(gen, 2, 40)
        with Trace() as t:
            row_topk(x, lengths, 7, torch.empty(4, 7, dtype=I32), slots=slots, next_n=2)
        traces.append(t.ops)
    assert traces[0] == traces[1]
    assert not [op for op, _ in traces[0] if any(b in op for b in SYNCING_OPS)]


def bad_slot_maps() -> list[tuple[str, dict]]:
    """(field, keywords) a top-k over 4 rows must refuse, whatever the provider."""
    table = torch.zeros(2, 8, dtype=I32)
    return [
        ("slots", {"slots": table.long(), "next_n": 2}),  # wrong dtype
        ("slots", {"slots": torch.zeros(2, 2, 8, dtype=I32), "next_n": 2}),  # not 2-D
        ("slots", {"slots": table, "next_n": 1}),  # 2 requests for 4 rows of 1
        ("slots", {"slots": table, "next_n": 4}),  # 2 requests for 4 rows of 4
        ("next_n", {"slots": table, "next_n": 3}),  # 4 rows are not a multiple of 3
        ("next_n", {"slots": table, "next_n": 0}),
        ("next_n", {"slots": table, "next_n": 2.0}),
        ("slots", {"slots": torch.zeros(8, 2, dtype=I32).t(), "next_n": 2}),  # column stride
        ("slots", {"slots": torch.zeros(2, 0, dtype=I32), "next_n": 2}),  # no column to read
    ]


@pytest.mark.parametrize(("field", "kw"), bad_slot_maps())
def test_slot_map_checks_name_the_field(field: str, kw: dict) -> None:
    x, lengths = torch.zeros(4, 8), torch.full((4,), 8, dtype=I32)
    out = torch.empty(4, 3, dtype=I32)
    with pytest.raises(PlanError) as e:
        row_topk(x, lengths, 3, out, **kw)
    assert e.value.field == field
    with pytest.raises(PlanError) as e:
        map_positions_to_slots(out, kw["slots"], kw["next_n"])
    assert e.value.field == field
    if triton_available(torch.device("cpu")):
        with pytest.raises(PlanError) as e:
            row_topk_triton(x, lengths, 3, out, **kw)
        assert e.value.field == field


# ------------------------------------------------------------------------ triton


# Each kernel at interpreter-sized blocks: the chunked one at a block below most widths,
# the resident one whole-row (its default block) and at a block that sends longer rows
# through its re-read chunks, at the default digit width and at 4 and 8 bits.
KERNELS = {
    "chunked": {"variant": "chunked", "block": 64},
    "resident": {},
    "resident32-d8": {"variant": "resident", "resident": 32, "digit_bits": 8},
    "resident64-d4": {"variant": "resident", "resident": 64, "digit_bits": 4},
}


# The edge cases at the smallest blocks: most rows cross chunk boundaries (the resident
# kernel's re-read chunks among them), and the resident kernel's default for contrast.
EDGE_KERNELS = {
    "chunked16": {"variant": "chunked", "block": 16},
    "resident16": {"variant": "resident", "resident": 16},
    "resident": {},
}


def check_triton(x: torch.Tensor, lengths: torch.Tensor, k: int, **kw) -> None:
    want = reference_row_topk(x, lengths, k)
    got = torch.full_like(want, 12345)  # poison: every entry must be written
    row_topk_triton(x, lengths, k, got, **kw)
    assert torch.equal(got, want), (lengths.tolist(), k, got, want)


@needs_triton
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("kind", ["distinct", "ties", "nasty", "normal"])
def test_triton_matches_reference_bit_for_bit(kind: str, kernel: str) -> None:
    gen = torch.Generator().manual_seed(["distinct", "ties", "nasty", "normal"].index(kind))
    for width, k in ((0, 3), (1, 1), (37, 1), (90, 7), (130, 64), (60, 60), (40, 61), (200, 17)):
        rows = 3
        x = random_case(gen, rows, width, kind)
        lengths = torch.randint(-1, width + 3, (rows,), generator=gen, dtype=I32)
        lengths[0] = width  # always one full row
        check_triton(x, lengths, k, **KERNELS[kernel])


@needs_triton
@pytest.mark.parametrize("kernel", list(EDGE_KERNELS))
def test_triton_edge_rows(kernel: str) -> None:
    kw = EDGE_KERNELS[kernel]
    # Every length 0..width in one batch; block smaller than k and than the row.
    x = torch.randint(-3, 4, (33, 32)).float()
    check_triton(x, torch.arange(33, dtype=I32), 5, **kw)
    # All scores equal: the k lowest positions.
    check_triton(torch.ones(2, 50), torch.tensor([50, 30], dtype=I32), 9, **kw)
    # Mostly NaN (fewer candidates than k), all NaN, all -inf.
    x = torch.full((3, 40), NAN)
    x[0, ::10] = 1.0
    x[2] = -INF
    check_triton(x, torch.tensor([40, 40, 40], dtype=I32), 6, **kw)
    # Only the lowest bit separates the threshold from the next key.
    base = torch.tensor(1.0)
    nxt = torch.nextafter(base, torch.tensor(2.0))
    x = torch.stack([base, nxt, base, nxt, base]).repeat(2, 4)
    check_triton(x, torch.tensor([20, 13], dtype=I32), 7, **kw)


def check_triton_slots(
    x: torch.Tensor, lengths: torch.Tensor, k: int, slots: torch.Tensor, next_n: int, **kw
) -> None:
    want = mapped_reference(x, lengths, k, slots, next_n)
    got = torch.full_like(want, 12345)  # poison: every entry must be written
    row_topk_triton(x, lengths, k, got, slots=slots, next_n=next_n, **kw)
    assert torch.equal(got, want), (lengths.tolist(), k, next_n, got, want)


@needs_triton
@pytest.mark.parametrize("kernel", ["chunked", "resident"])
@pytest.mark.parametrize("next_n", [1, 2, 3])
@pytest.mark.parametrize("kind", ["distinct", "ties", "nasty"])
def test_triton_slot_map_matches_reference_then_mapping(
    kind: str, next_n: int, kernel: str
) -> None:
    gen = torch.Generator().manual_seed(10 * next_n + ["distinct", "ties", "nasty"].index(kind))
    for width, k in ((0, 3), (37, 1), (60, 7), (40, 61), (45, 17)):
        reqs = 2
        rows = reqs * next_n
        x = random_case(gen, rows, width, kind)
        lengths = torch.randint(-1, width + 3, (rows,), generator=gen, dtype=I32)
        lengths[0] = width  # always one full row
        lengths[-1] = min(k, width)  # and one that fits, taken unscored
        slots = random_slots(gen, reqs, max(width, 1))
        check_triton_slots(x, lengths, k, slots, next_n, **KERNELS[kernel])


@needs_triton
@pytest.mark.parametrize("kernel", list(EDGE_KERNELS))
def test_triton_slot_map_edge_rows(kernel: str) -> None:
    kw = EDGE_KERNELS[kernel]
    gen = torch.Generator().manual_seed(5)
    # Every length 0..width, request by request; block smaller than k and than the row.
    x = torch.randint(-3, 4, (21, 20), generator=gen).float()
    check_triton_slots(x, torch.arange(21, dtype=I32), 5, random_slots(gen, 7, 20), 3, **kw)
    # Mostly NaN (fewer candidates than k), all NaN, all -inf, +-0 only.
    x = torch.full((4, 40), NAN)
    x[0, ::10] = 1.0
    x[2] = -INF
    x[3] = torch.tensor([0.0, -0.0]).repeat(20)
    check_triton_slots(x, torch.full((4,), 40, dtype=I32), 6, random_slots(gen, 2, 40), 2, **kw)
    # A slot table narrower than the logits: positions past it read its last column, as
    # the reference's clamp does; one wider than the logits is read only up to the length.
    x = torch.randn(4, 24, generator=gen)
    lengths = torch.tensor([24, 9, 30, 3], dtype=I32)
    for table_width in (1, 10, 50):
        check_triton_slots(x, lengths, 12, random_slots(gen, 4, table_width), 1, **kw)
    # A table whose rows are all one stored row (stride 0), like an expanded view.
    table = torch.arange(100, 124, dtype=I32).expand(2, 24)
    check_triton_slots(x, lengths, 5, table, 2, **kw)


@needs_triton
@pytest.mark.parametrize("digit_bits", [4, 5, 6, 7, 8])
def test_resident_lengths_around_k_and_the_block(digit_bits: int) -> None:
    """Lengths at 0, 1, k - 1, k, k + 1 and either side of one and two resident blocks, for
    a k below the block and one above it (rows that fit then span re-read chunks)."""
    gen = torch.Generator().manual_seed(20 + digit_bits)
    width, block = 100, 32
    kw = {"variant": "resident", "resident": block, "digit_bits": digit_bits}
    for k, next_n in ((20, 1), (45, 2)):
        lengths = [0, 1, k - 1, k, k + 1, block - 1, block, block + 1, 2 * block + 1, width]
        lengths = torch.tensor(lengths, dtype=I32)
        for kind in ("distinct", "ties", "nasty"):
            check_triton(random_case(gen, 10, width, kind), lengths, k, **kw)
        x = random_case(gen, 10, width, "normal")
        check_triton_slots(x, lengths, k, random_slots(gen, 10 // next_n, width), next_n, **kw)


@needs_triton
def test_resident_ties_and_signed_zeros_across_chunks() -> None:
    """Threshold ties whose lowest positions straddle re-read chunks, and zeros of both
    signs that must tie wherever they sit."""
    kw = {"variant": "resident", "resident": 16}
    # 7 distinct bests, then a tie of 40 ones: the lowest 13 ones fill k = 20.
    x = torch.ones(3, 70)
    x[0, torch.tensor([3, 20, 33, 50, 51, 60, 69])] = 2.0
    x[1, ::2] = -0.0  # +-0 only, alternating: the lowest positions win
    x[1, 1::2] = 0.0
    x[2] = torch.where(torch.arange(70) % 3 == 0, -0.0, 0.0)
    x[2, 65:] = NAN
    check_triton(x, torch.tensor([70, 70, 70], dtype=I32), 20, **kw)
    # Ties at every digit width: the threshold key is fixed only at bit 0.
    for bits in (4, 5, 6, 7, 8):
        base = torch.tensor(-3.0)
        nxt = torch.nextafter(base, torch.tensor(0.0))
        y = torch.stack([base, nxt]).repeat(3, 25)
        check_triton(y, torch.tensor([50, 49, 33], dtype=I32), 31, resident=16, digit_bits=bits)


@needs_triton
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    width=st.integers(1, 90),
    k=st.integers(1, 40),
    block=st.sampled_from([16, 32, 128]),
    digit_bits=st.integers(4, 8),
)
def test_resident_matches_reference_on_random_rows(
    data: st.DataObject, width: int, k: int, block: int, digit_bits: int
) -> None:
    """Few distinct values (ties everywhere), NaN, infinities and signed zeros, at any
    length, block and digit width."""
    values = st.sampled_from([NAN, -INF, INF, -0.0, 0.0, 1.0, -1.0, 2.5, 1e-38, -1e-38])
    rows = data.draw(st.integers(1, 3))
    x = torch.tensor(data.draw(st.lists(values, min_size=rows * width, max_size=rows * width)))
    lengths = data.draw(st.lists(st.integers(-2, width + 2), min_size=rows, max_size=rows))
    kw = {"variant": "resident", "resident": block, "digit_bits": digit_bits}
    check_triton(x.view(rows, width), torch.tensor(lengths, dtype=I32), k, **kw)


@needs_triton
@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"variant": "sorted"}, "variant"),
        ({"variant": "resident", "resident": 48}, "resident"),
        ({"variant": "resident", "resident": 2**15}, "resident"),
        ({"variant": "resident", "digit_bits": 3}, "digit_bits"),
        ({"variant": "resident", "digit_bits": 9}, "digit_bits"),
        ({"variant": "chunked", "block": 8}, "block"),
    ],
)
def test_triton_knobs_are_checked(knobs: dict, message: str) -> None:
    x, lengths = torch.zeros(2, 8), torch.full((2,), 8, dtype=I32)
    out = torch.full((2, 3), 7, dtype=I32)
    with pytest.raises(ValueError, match=message):
        row_topk_triton(x, lengths, 3, out, **knobs)
    assert (out == 7).all()  # refused before any launch


@needs_triton
def test_row_topk_forwards_slots_to_the_triton_provider(monkeypatch) -> None:
    monkeypatch.setattr(topk_module, "row_topk_provider", lambda device: "triton")
    gen = torch.Generator().manual_seed(9)
    x = random_case(gen, 4, 50, "normal")
    lengths = torch.tensor([50, 3, 0, 21], dtype=I32)
    slots = random_slots(gen, 2, 50)
    out = torch.full((4, 8), 12345, dtype=I32)
    assert row_topk(x, lengths, 8, out, slots=slots, next_n=2) is out
    assert torch.equal(out, mapped_reference(x, lengths, 8, slots, 2))


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_indexer_topk_is_the_old_topk_then_torch_mapping(monkeypatch, provider: str) -> None:
    """The decode indexer, wired to the fused call, returns what its former seven torch ops
    after a positions-only top-k returned (written out here as they were)."""
    if provider == "triton" and not triton_available(torch.device("cpu")):
        pytest.skip("no interpreter")
    from backends.nsa import attention as nsa

    gen = torch.Generator().manual_seed(13)
    reqs, next_n, width, topk = 3, 2, 40, 8
    rows = reqs * next_n
    logits = random_case(gen, rows, width, "ties")
    kv_lens = torch.tensor([40, 39, 5, 6, 0, 23], dtype=I32)
    token_slots = random_slots(gen, reqs, width)
    plan = SimpleNamespace(
        next_n=next_n,
        kernel_next_n=next_n,
        topk=topk,
        max_seq_len=width,
        kv_lens=kv_lens,
        schedule=None,
        token_slots=token_slots,
        kernel_page_table=None,
    )
    monkeypatch.setattr(nsa, "fp8_paged_mqa_logits", lambda *args: logits)
    monkeypatch.setattr(topk_module, "row_topk_provider", lambda device: provider)
    got = nsa.indexer_topk(plan, torch.zeros(rows, 1, 1), torch.zeros(rows, 1), None)

    idx = reference_row_topk(logits, kv_lens, topk)
    req_of_row = torch.arange(rows) // next_n
    col = idx.clamp(min=0, max=token_slots.shape[1] - 1).long()
    slots = token_slots[req_of_row.unsqueeze(1), col]
    want = torch.where(idx >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)


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
def test_every_triton_kernel_matches_on_cuda() -> None:
    """The resident kernel at each digit width and warp count, whole-row and with re-read
    chunks, and the chunked one, against the reference at decode sizes, slots too."""
    gen = torch.Generator().manual_seed(17)
    kernels = [{"variant": "chunked"}, {"variant": "resident", "digit_bits": 4}]
    kernels += [
        {"variant": "resident", "digit_bits": bits, "num_warps": warps}
        for bits in (5, 8)
        for warps in (4, 8, 16)
    ]
    kernels.append({"variant": "resident", "resident": 1024})  # re-read chunks
    for kind in ("distinct", "ties", "nasty", "normal"):
        for width, k, rows in ((4096, 2048, 64), (16384, 2048, 16), (3000, 100, 8)):
            x = random_case(gen, rows, width, kind, "cuda")
            lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=I32).cuda()
            lengths[:3] = torch.tensor([width, k, k + 1], dtype=I32)
            slots = random_slots(gen, rows, width, "cuda")
            want = reference_row_topk(x, lengths, k)
            want_mapped = map_positions_to_slots(want, slots, 1)
            for kw in kernels:
                got = torch.full_like(want, 12345)
                row_topk_triton(x, lengths, k, got, **kw)
                assert torch.equal(got, want), (kind, width, kw)
                row_topk_triton(x, lengths, k, got, slots=slots, **kw)
                assert torch.equal(got, want_mapped), (kind, width, kw, "slots")


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


@pytest.mark.gpu
def test_triton_slot_map_matches_on_cuda_and_replays_in_a_graph() -> None:
    gen = torch.Generator().manual_seed(11)
    for next_n in (1, 2):
        reqs, width, k = 32, 4096, 2048
        rows = reqs * next_n
        x = random_case(gen, rows, width, "ties", "cuda")
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=I32).cuda()
        slots = random_slots(gen, reqs, width, "cuda")
        out = torch.empty(rows, k, dtype=I32, device="cuda")
        row_topk(x, lengths, k, out, slots=slots, next_n=next_n)  # compile outside the capture
        assert torch.equal(out, mapped_reference(x, lengths, k, slots, next_n))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            row_topk(x, lengths, k, out, slots=slots, next_n=next_n)
        x.copy_(random_case(gen, rows, width, "normal", "cuda"))
        lengths.copy_(torch.randint(0, width + 1, (rows,), generator=gen, dtype=I32).cuda())
        slots.copy_(random_slots(gen, reqs, width, "cuda"))
        graph.replay()
        assert torch.equal(out, mapped_reference(x, lengths, k, slots, next_n))
