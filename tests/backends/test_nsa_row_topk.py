"""Length-aware row top-k: the reference against hand-worked rows and ``torch.topk``, the
fused position-to-slot mapping the decode indexer uses, and the dispatch between providers.
The Triton kernels against the reference are in ``test_nsa_row_topk_triton.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.nsa import topk as topk_module
from backends.nsa.topk import row_topk, row_topk_provider
from backends.nsa.topk_ref import map_positions_to_slots, order_keys, reference_row_topk
from backends.nsa.topk_triton import row_topk_triton
from planner.errors import PlanError
from tests.support.row_topk_cases import (
    I32,
    INF,
    NAN,
    SYNCING_OPS,
    Trace,
    mapped_reference,
    random_case,
    random_slots,
    ref,
)

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


@pytest.mark.triton
@pytest.mark.parametrize(("field", "kw"), bad_slot_maps())
def test_the_triton_provider_checks_slot_maps_by_the_same_names(field: str, kw: dict) -> None:
    x, lengths = torch.zeros(4, 8), torch.full((4,), 8, dtype=I32)
    with pytest.raises(PlanError) as e:
        row_topk_triton(x, lengths, 3, torch.empty(4, 3, dtype=I32), **kw)
    assert e.value.field == field


@pytest.mark.triton
def test_row_topk_forwards_slots_to_the_triton_provider(monkeypatch) -> None:
    monkeypatch.setattr(topk_module, "row_topk_provider", lambda device: "triton")
    gen = torch.Generator().manual_seed(9)
    x = random_case(gen, 4, 50, "normal")
    lengths = torch.tensor([50, 3, 0, 21], dtype=I32)
    slots = random_slots(gen, 2, 50)
    out = torch.full((4, 8), 12345, dtype=I32)
    assert row_topk(x, lengths, 8, out, slots=slots, next_n=2) is out
    assert torch.equal(out, mapped_reference(x, lengths, 8, slots, 2))


@pytest.mark.parametrize("provider", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_indexer_topk_is_the_old_topk_then_torch_mapping(monkeypatch, provider: str) -> None:
    """The decode indexer, wired to the fused call, returns what its former seven torch ops
    after a positions-only top-k returned (written out here as they were)."""
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
