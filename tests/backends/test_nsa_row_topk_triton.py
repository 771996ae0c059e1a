"""The length-aware row top-k's Triton kernels bit for bit against the reference (the
interpreter here, compiled on the GPU), with and without the fused slot mapping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.nsa.topk import row_topk, row_topk_provider
from backends.nsa.topk_ref import map_positions_to_slots, reference_row_topk
from backends.nsa.topk_triton import row_topk_triton
from tests.support.row_topk_cases import (
    I32,
    INF,
    NAN,
    mapped_reference,
    random_case,
    random_slots,
)

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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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


@pytest.mark.triton
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
