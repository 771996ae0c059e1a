"""``nsa.mla_fixed_splits``: a split count per row that no longer depends on the batch.

The wave model (the default, ``0``) gives the sparse MLA kernel fewer splits as the rows
grow, so a row is cut at other boundaries, and its split-KV combine sums in another order,
in a decode of 8 rows than in a verify of 32 (issue 39). With a fixed count ``N`` every
row is cut into ``N`` splits by its own top-k length alone. Checked here: the derived
dimension for every plan and row count, the split table of a row alone and inside batches
for every provider (and through the planner), the Triton kernel's output of a row alone and
inside batches (fp32, under the interpreter), and the refusals. The bf16 CUDA half is
``tests/gpu/test_batch_invariant_mla_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.nsa import mla_split
from backends.nsa.sparse_mla_plan import (
    MAX_SPLITS,
    SparseMLAConfig,
    new_split_plan,
    sparse_mla_num_splits,
    split_plan_torch,
)
from backends.nsa.sparse_mla_triton import sparse_mla_decode_triton
from planner import ConfigError, ForwardMode, Limits, Planner, SchemaError
from planner.ops import get_op
from tests.support.planners import PlannerSetup, replay_smallest

I32 = torch.int32
TOPK = 2048
SMS = 132
SIZES = (1, 2, 8, 32, 64)
VERIFY_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
RAGGED_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


def _planner(**options) -> Planner:
    limits = Limits(max_batch=64, max_context=4096, page_size=64, next_n=2, num_sms=SMS)
    return Planner(["nsa"], limits, options={"nsa": {"topk": TOPK, **options}})


def _rows(planner: Planner, mode: ForwardMode, bs: int) -> tuple[dict, int]:
    if mode in RAGGED_MODES:
        dims = planner.dims(mode, bs, 1500, tokens=bs * 3)
        return dims, bs * 3
    dims = planner.dims(mode, bs, 1500)
    return dims, dims["rows"]


# --- (1) the derived dimension -----------------------------------------------------------


@pytest.mark.parametrize("fixed", [1, 4, 7, MAX_SPLITS])
def test_a_fixed_count_is_the_splits_of_every_plan_at_every_size(fixed):
    planner = _planner(mla_fixed_splits=fixed)
    for mode in VERIFY_MODES + RAGGED_MODES:
        for bs in SIZES:
            dims, rows = _rows(planner, mode, bs)
            assert dims["mla_splits"] == fixed, (mode, bs)
            assert dims["mla_split_cells"] == rows * (fixed + 1), (mode, bs)


@pytest.mark.parametrize("options", [{}, {"mla_fixed_splits": 0}])
def test_without_it_the_wave_model_decides(options):
    planner = _planner(**options)
    seen = set()
    for mode in VERIFY_MODES + RAGGED_MODES:
        for bs in SIZES:
            dims, rows = _rows(planner, mode, bs)
            wave = sparse_mla_num_splits(rows, heads=128, topk=TOPK, num_sms=SMS)
            assert dims["mla_splits"] == wave, (mode, bs)
            seen.add(wave)
    assert {32, 8, 2, 1} <= seen  # the measured 1 -> 32, 8 -> 8, 32 -> 2, 64+ -> 1 rows


# --- (2) the split table of a row, alone and inside batches --------------------------------


def _run(provider: str, splits: int, lens: torch.Tensor, topk: int) -> list[int]:
    """The flat table of ``lens`` as the op's ``provider`` writes it (over garbage)."""
    op = get_op("sparse_mla_split_plan")
    params = {"topk": topk, "block_n": 64}
    cells = lens.shape[0] * (splits + 1)
    out = torch.full((cells,), -7, dtype=I32)
    op.providers[provider].fn(out, lens, **params)
    return out.tolist()


PROVIDERS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("fixed", [1, 4, 32])
def test_a_rows_table_is_the_same_alone_and_anywhere_in_any_batch(provider, fixed):
    rng = random.Random(fixed)
    topk = 1024
    for target in (0, 1, 63, 64, 65, 700, 1023, 1024, 1500):
        alone = _run(provider, fixed, torch.tensor([target], dtype=I32), topk)
        assert alone[0] == 0 and alone[-1] == min(target, topk)
        for size in (8, 32, 64):
            others = [rng.randint(0, 2 * topk) for _ in range(size - 1)]
            for pos in sorted({0, size // 2, size - 1, rng.randrange(size)}):
                lens = torch.tensor(others[:pos] + [target] + others[pos:], dtype=I32)
                flat = _run(provider, fixed, lens, topk)
                w = fixed + 1
                assert flat[pos * w : (pos + 1) * w] == alone, (target, size, pos)


NEXT_N = 2
SETUP = PlannerSetup(
    ("nsa",),
    40,
    700,
    64,
    pool=60,
    seed=5,
    limits={"num_sms": 8, "next_n": NEXT_N},
    options={"nsa": {"topk": 96, "mla_fixed_splits": 3}},
)


def _alone(length: int, splits: int, topk: int) -> list[int]:
    table = new_split_plan(1, splits)
    split_plan_torch(table, torch.tensor([length], dtype=I32), topk=topk, block_n=64)
    return table[0].tolist()


def test_through_the_planner_every_rows_table_is_its_own_eager_and_replayed():
    """Decode and verify plans of any size, eager and replayed into a larger captured size:
    every row's table is that of its length alone, 3 splits."""
    planner = SETUP.planner()
    sizes = (8, 40)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        for bs in sizes:
            planner.capture(bs, mode, req_to_token=SETUP.table)
    rng = random.Random(11)
    for step in range(8):
        mode = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)[step % 2]
        batch = SETUP.batch(rng, next_n=NEXT_N, mode=mode, bs=rng.choice([1, 5, 8, 33]))
        eager = planner.plan(batch)["nsa"]
        _, replayed = replay_smallest(planner, batch, sizes)
        for plan in (eager, replayed["nsa"]):
            assert plan.mla_splits == 3
            table = plan.mla_split_plan.view(-1, 4)
            lens = plan.topk_lens.tolist()
            for r in range(eager.topk_lens.shape[0]):
                assert table[r].tolist() == _alone(lens[r], 3, 96), (mode, batch.bs, r)


# --- (3) the kernel: a row's output alone and inside batches -------------------------------

HEADS, LATENT, ROPE, SLOTS, KTOPK = 4, 32, 16, 256, 96
CFG = SparseMLAConfig(block_n=16)
SCALE = 0.3


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, LATENT, generator=g)
    qr = torch.randn(n, HEADS, ROPE, generator=g)
    idx = torch.randint(0, SLOTS, (n, KTOPK), generator=g, dtype=I32)
    idx[torch.rand(n, KTOPK, generator=g) < 0.2] = -1
    lens = torch.randint(1, KTOPK + 1, (n,), generator=g, dtype=I32)
    idx[torch.arange(KTOPK).unsqueeze(0) >= lens.unsqueeze(1)] = -1
    return q, qr, idx, lens


def _kernel_row(fixed: int, size: int, pos: int, target, kv, seed: int) -> torch.Tensor:
    """Row ``pos`` of the kernel's output over ``size`` rows, the target row placed there,
    with the split count the plan derives for ``size`` rows (fixed or the wave model's)."""
    q, qr, idx, lens = (
        torch.cat([a[:pos], t, a[pos:]]) for a, t in zip(_inputs(size - 1, seed), target)
    )
    settings = {"mla_fixed_splits": fixed, "mla_heads": HEADS, "topk": KTOPK}
    if fixed:
        splits = mla_split.split_dims(size, {"sms": 8}, settings)["mla_splits"]
    else:  # the wave model of the kernel config the table is cut for
        splits = sparse_mla_num_splits(size, heads=HEADS, topk=KTOPK, num_sms=8, config=CFG)
    plan = new_split_plan(size, splits)
    split_plan_torch(plan, lens, topk=KTOPK, block_n=CFG.block_n)
    out = sparse_mla_decode_triton(q, qr, kv, idx, SCALE, split_plan=plan, config=CFG)
    return out[pos]


def _target_and_kv():
    g = torch.Generator().manual_seed(99)
    kv = torch.randn(SLOTS, LATENT + ROPE, generator=g)
    q, qr, idx, _ = _inputs(1, 7)
    idx[0, 90:] = -1
    return (q, qr, idx, torch.tensor([90], dtype=I32)), kv


@pytest.mark.triton
@pytest.mark.parametrize("fixed", [1, 4])
def test_the_kernels_row_is_bit_identical_alone_and_inside_batches(fixed):
    target, kv = _target_and_kv()
    alone = _kernel_row(fixed, 1, 0, target, kv, seed=0)
    assert torch.isfinite(alone).all()
    for size, pos in ((8, 3), (32, 31), (64, 0)):
        got = _kernel_row(fixed, size, pos, target, kv, seed=size)
        assert torch.equal(got, alone), (fixed, size, pos)


@pytest.mark.triton
def test_without_it_the_same_row_differs_between_batch_sizes():
    """The demonstration: the wave model cuts the lone row into 6 splits and combines them,
    but writes it directly from one split in a batch of 64; in fp32 the sums differ in the
    last bits (the row is still right within tolerance, just not the same bits)."""
    target, kv = _target_and_kv()
    assert sparse_mla_num_splits(1, heads=HEADS, topk=KTOPK, num_sms=8, config=CFG) == 6
    assert sparse_mla_num_splits(64, heads=HEADS, topk=KTOPK, num_sms=8, config=CFG) == 1
    alone = _kernel_row(0, 1, 0, target, kv, seed=0)
    batched = _kernel_row(0, 64, 0, target, kv, seed=64)
    assert torch.allclose(batched, alone, rtol=1e-5, atol=1e-6)
    assert not torch.equal(batched, alone)


# --- (4) refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (-1, SchemaError),
        (MAX_SPLITS + 1, SchemaError),
        (1000, SchemaError),
        (True, ConfigError),
        (2.0, ConfigError),
        ("4", ConfigError),
    ],
)
def test_out_of_range_or_mistyped_counts_are_refused_by_name(value, error):
    with pytest.raises(error) as info:
        _planner(mla_fixed_splits=value)
    assert info.value.field == "nsa.mla_fixed_splits"
    if error is SchemaError:
        assert str(MAX_SPLITS) in str(info.value.expected)


def test_the_settings_check_refuses_by_name_on_its_own():
    base = {"mla_heads": 128, "mla_kernel": "auto"}
    for value in (-3, MAX_SPLITS + 1, False, None):
        with pytest.raises(SchemaError) as info:
            mla_split.check_settings({**base, "mla_fixed_splits": value})
        assert info.value.field == "nsa.mla_fixed_splits"
    for value in (0, 1, MAX_SPLITS):
        mla_split.check_settings({**base, "mla_fixed_splits": value})
