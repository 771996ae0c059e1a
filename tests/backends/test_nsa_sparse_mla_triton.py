"""The Triton sparse MLA decode kernel and its split plan, under the interpreter (tiny shapes).

Three layers of checks: the split plan (Triton bit-equal to its torch reference, and the
properties the kernel relies on), the split-path reference (equal to the plain
``sparse_mla_decode``, so the split algebra is right), and the kernel (equal to both
within the stated tolerance: ~1e-6 with fp32 inputs, under 1e-2 worst case and ~2e-3
typical with bf16/fp16). Outputs and workspaces are poisoned first, so an unwritten
element or a read of a never-written split shows up as nan.
"""

from __future__ import annotations

import json

import pytest
import torch

from backends.nsa.sparse_mla_plan import (
    SparseMLAConfig,
    new_split_plan,
    new_workspace,
    sparse_mla_num_splits,
    sparse_mla_split_plan,
    split_plan_torch,
    split_plan_triton,
    workspace_numel,
)
from backends.nsa.sparse_mla_ref import mask_past_plan, plain_reference, sparse_mla_split_reference
from backends.nsa.sparse_mla_triton import sparse_mla_decode_triton
from planner.errors import PlanError

I32 = torch.int32
SCALE = 0.3
BN16 = SparseMLAConfig(block_n=16)
LAZY = SparseMLAConfig(block_n=16, lazy_rescale=True)


def make_case(
    lens, *, heads=4, latent=32, rope=16, topk=40, slots=96, dtype=torch.bfloat16, holes=0.2, seed=0
):
    """Random inputs as the indexer leaves them: -1 past each row's length, holes inside."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lens)
    q = torch.randn(rows, heads, latent, generator=g).to(dtype)
    qr = torch.randn(rows, heads, rope, generator=g).to(dtype)
    kv = torch.randn(slots, latent + rope, generator=g).to(dtype)
    idx = torch.randint(0, slots, (rows, topk), generator=g, dtype=I32)
    idx[torch.rand(rows, topk, generator=g) < holes] = -1
    lens_t = torch.tensor(lens, dtype=I32)
    idx[torch.arange(topk).unsqueeze(0) >= lens_t.unsqueeze(1)] = -1
    return q, qr, kv, idx, lens_t


def plan_for(lens, splits, topk, block_n=16):
    plan = new_split_plan(lens.shape[0], splits)
    split_plan_torch(plan, lens, topk=topk, block_n=block_n)
    return plan


def poisoned_out(q):
    return torch.full_like(q, float("nan"))


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# --- split plan ----------------------------------------------------------------------


def test_split_plan_known_values():
    plan = plan_for(torch.tensor([40, 17, 0], dtype=I32), 3, topk=40)
    assert plan.tolist() == [[0, 16, 32, 40], [0, 16, 17, 17], [0, 0, 0, 0]]


@pytest.mark.triton
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
    tile32 = {**h200, "config": SparseMLAConfig()}  # 32-key tiles: up to 64 splits
    assert [sparse_mla_num_splits(b, **tile32) for b in (1, 16, 64, 128)] == [64, 4, 1, 1]
    # the default's 64-key tiles: at most 32 splits of a 2048-slot row
    assert [sparse_mla_num_splits(b, **h200) for b in (1, 16, 64, 128)] == [32, 4, 1, 1]
    assert sparse_mla_num_splits(0, **h200) == 1
    for rows in range(1, 300, 7):
        s = sparse_mla_num_splits(rows, **h200)
        assert 1 <= s <= 64
    assert workspace_numel(4, 1, 8, 32) == 0 and workspace_numel(4, 3, 8, 32) == 4 * 3 * 8 * 33


# --- split-path reference --------------------------------------------------------------


def test_split_reference_equals_the_plain_reference():
    q, qr, kv, idx, lens = make_case([40, 17, 0, 33, 1], dtype=torch.float64, seed=3)
    for splits in (1, 2, 3, 7):
        plan = plan_for(lens, splits, topk=40)
        ref = sparse_mla_split_reference(q, qr, kv, idx, SCALE, plan)
        plain = plain_reference(q, qr, kv, idx, SCALE, plan)
        assert rel(ref.out, plain) < 1e-6  # plain runs in fp32
        assert ref.out.shape == q.shape and ref.lse.shape == (5, splits, 4)


# --- the kernel ----------------------------------------------------------------------


CASES = [  # (lens, splits, heads, topk)
    ([40], 1, 4, 40),
    ([40], 4, 4, 40),
    ([9, 40, 23], 2, 4, 40),
    ([8, 3, 8, 1, 5], 3, 4, 8),
    ([33, 0, 17, 40], 4, 20, 40),  # two head blocks, the second one partial
    ([25, 25], 1, 20, 32),
]


@pytest.mark.triton
@pytest.mark.parametrize("config", [BN16, LAZY], ids=["eager-rescale", "lazy-rescale"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp32_kernel_matches_the_split_reference_tightly(case, config):
    lens, splits, heads, topk = CASES[case]
    q, qr, kv, idx, lens_t = make_case(lens, heads=heads, topk=topk, dtype=torch.float32, seed=case)
    plan = plan_for(lens_t, splits, topk)
    ws = torch.full((workspace_numel(len(lens), splits, heads, 32),), float("nan"))
    out = sparse_mla_decode_triton(
        q, qr, kv, idx, SCALE, split_plan=plan, out=poisoned_out(q), workspace=ws, config=config
    )
    ref = sparse_mla_split_reference(q, qr, kv, idx, SCALE, plan)
    assert not out.isnan().any()
    assert rel(out, ref.out) < 1e-5
    if splits > 1:  # the partials themselves, where the kernel wrote them
        n_o = len(lens) * splits * heads * 32
        part = ws[:n_o].view(len(lens), splits, heads, 32)
        lse = ws[n_o:].view(len(lens), splits, heads)
        live = (plan[:, 1:] > plan[:, :-1]).unsqueeze(-1).expand_as(lse)
        assert torch.allclose(lse[live].double(), ref.lse[live], rtol=1e-5, atol=1e-5)
        assert rel(part[live], ref.partial[live]) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_kernel_is_within_the_stated_tolerance(dtype):
    errors = []
    for case, (lens, splits, heads, topk) in enumerate(CASES):
        q, qr, kv, idx, lens_t = make_case(
            lens, heads=heads, topk=topk, dtype=dtype, seed=10 + case
        )
        plan = plan_for(lens_t, splits, topk)
        out = sparse_mla_decode_triton(
            q, qr, kv, idx, SCALE, split_plan=plan, out=poisoned_out(q), config=BN16
        )
        assert out.dtype == dtype and not out.isnan().any()
        errors.append(rel(out, plain_reference(q, qr, kv, idx, SCALE, plan)))
    assert max(errors) < 1e-2, errors
    assert sum(errors) / len(errors) < 3e-3, errors


@pytest.mark.triton
def test_lazy_rescale_with_rising_and_falling_maxima():
    """Logits that climb by 18 (log2) per 16-key tile force a rescale on every tile (and
    would overflow fp16, whose range 2^16 is what bounds the 2^8 slack, if the slack were
    any wider); falling ones never rescale after the first. Both equal the reference."""
    latent, topk = 32, 64
    u = torch.ones(latent) / latent**0.5
    kv = torch.zeros(topk, latent + 16)
    kv[:, :latent] = torch.arange(topk).unsqueeze(1) * (0.078 * u)  # 0.78 nats a key
    q = (10 * u).expand(2, 4, latent).clone()
    qr = torch.zeros(2, 4, 16)
    idx = torch.stack([torch.arange(topk), torch.arange(topk).flip(0)]).to(I32)
    lens = torch.tensor([topk, topk], dtype=I32)
    for splits in (1, 2):
        plan = plan_for(lens, splits, topk)
        ref = sparse_mla_split_reference(q, qr, kv, idx, 1.0, plan).out
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
            args = (q.to(dtype), qr.to(dtype), kv.to(dtype), idx, 1.0)
            lazy = sparse_mla_decode_triton(*args, split_plan=plan, config=LAZY)
            assert rel(lazy, ref) < tol


@pytest.mark.triton
@pytest.mark.parametrize("config", [BN16, LAZY], ids=["eager-rescale", "lazy-rescale"])
def test_rows_without_valid_slots_are_zero_and_extremes_are_exact(config):
    """All-holes rows, empty rows, all-valid rows and duplicated slots, split and direct."""
    q, qr, kv, idx, lens = make_case([40, 40, 0, 40, 12], topk=40, dtype=torch.float32, seed=5)
    idx[0] = -1  # length 40 but nothing valid
    idx[1] = torch.randint(0, 96, (40,), dtype=I32)  # every slot valid
    idx[3] = 7  # one slot 40 times: the same as attending to it once
    idx[4, :12] = torch.tensor([3, 3, 3, 9, 9, -1, 3, 9, 11, 11, 11, 11], dtype=I32)
    for splits in (1, 3):
        plan = plan_for(lens, splits, 40)
        out = sparse_mla_decode_triton(
            q, qr, kv, idx, SCALE, split_plan=plan, out=poisoned_out(q), config=config
        )
        assert (out[0] == 0).all() and (out[2] == 0).all()
        assert torch.allclose(out[3], kv[7, :32].expand(4, 32), rtol=1e-5, atol=1e-6)
        assert rel(out, sparse_mla_split_reference(q, qr, kv, idx, SCALE, plan).out) < 1e-5


@pytest.mark.triton
def test_positions_past_the_plan_are_never_read():
    q, qr, kv, idx, lens = make_case([30, 11], topk=40, dtype=torch.float32, holes=0.0, seed=6)
    plan = plan_for(lens, 2, 40)
    clean = sparse_mla_decode_triton(q, qr, kv, idx, SCALE, split_plan=plan, config=BN16)
    idx[0, 30:] = 1  # valid-looking slots past the row's length
    idx[1, 11:] = 10**9  # would be an out-of-bounds read if touched
    dirty = sparse_mla_decode_triton(q, qr, kv, idx, SCALE, split_plan=plan, config=BN16)
    assert torch.equal(clean, dirty)
    assert torch.equal(mask_past_plan(idx, plan)[1, 11:], torch.full((29,), -1, dtype=I32))


@pytest.mark.triton
def test_strided_queries_and_output():
    """Views as the model makes them (einsum / split outputs) need no copy."""
    q, qr, kv, idx, lens = make_case([40, 20], heads=8, dtype=torch.float32, seed=7)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [rows, H, L] with head-major strides
    qr_wide = torch.cat([torch.zeros_like(qr), qr], dim=-1)[..., 16:]  # a slice of a wider row
    out = torch.full((8, 2, 32), float("nan")).transpose(0, 1)
    plan = plan_for(lens, 2, 40)
    got = sparse_mla_decode_triton(
        q_t, qr_wide, kv, idx, SCALE, split_plan=plan, out=out, config=BN16
    )
    assert got is out
    assert rel(got, sparse_mla_split_reference(q, qr, kv, idx, SCALE, plan).out) < 1e-5


@pytest.mark.triton
def test_no_host_syncs(monkeypatch):
    """Only shapes are checked: the launcher is capturable (the interpreter reads tensors
    through numpy, never through these)."""
    q, qr, kv, idx, lens = make_case([40, 20], dtype=torch.float32, seed=8)
    plan = plan_for(lens, 2, 40)
    ws = new_workspace(2, 2, 4, 32)

    def boom(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    split_plan_triton(plan, lens, topk=40, block_n=16)
    out = sparse_mla_decode_triton(
        q, qr, kv, idx, SCALE, split_plan=plan, workspace=ws, config=BN16
    )
    monkeypatch.undo()
    assert not out.isnan().any()


def _bad(field, **change):
    q, qr, kv, idx, lens = make_case([40, 20], dtype=torch.bfloat16, seed=9)
    args = {"q": q, "qr": qr, "kv": kv, "idx": idx, "plan": plan_for(lens, 2, 40)}
    args.update(change)
    extra = {k: args.pop(k) for k in ("out", "workspace") if k in args}
    with pytest.raises(PlanError) as e:
        sparse_mla_decode_triton(
            args["q"], args["qr"], args["kv"], args["idx"], SCALE, split_plan=args["plan"], **extra
        )
    assert e.value.field == field, str(e.value)


def test_argument_checks_name_the_field():
    q, qr, kv, idx, lens = make_case([40, 20], dtype=torch.bfloat16, seed=9)
    _bad("q_nope_abs", q=q.int())
    _bad("q_nope_abs", q=torch.zeros(2, 4, 24, dtype=torch.bfloat16))
    _bad("q_rope", qr=qr[:1])
    _bad("q_rope", qr=qr.half())
    _bad("kv_cache", kv=kv[:, :40])
    _bad("kv_cache", kv=torch.zeros(96, 60, dtype=torch.bfloat16)[:, :48])
    _bad("topk_slots", idx=idx.long())
    _bad("topk_slots", idx=idx[:1])
    _bad("split_plan", plan=new_split_plan(3, 2))
    _bad("split_plan", plan=new_split_plan(2, 0))
    _bad("split_plan", plan=new_split_plan(2, 2).long())
    _bad("out", out=torch.zeros(2, 4, 32))
    _bad("workspace", workspace=torch.zeros(10))
    _bad("q_nope_abs", q=torch.zeros(2, 4, 36, dtype=torch.bfloat16)[..., :32])
    with pytest.raises(PlanError) as e:
        sparse_mla_decode_triton(
            q, qr, kv, idx, float("nan"), split_plan=plan_for(lens, 1, 40), config=BN16
        )
    assert e.value.field == "softmax_scale"


@pytest.mark.triton
def test_benchmark_smoke_runs_on_the_cpu(tmp_path):
    """``python -m benchmarks sparse_mla --smoke``, so the GPU script cannot rot between
    sessions."""
    from benchmarks.kernels import sparse_mla as bench

    result = bench.run(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_sparse_mla.json").read_text())
    assert result["ok"] and saved["ok"]
    assert saved["accuracy"]["batches"] >= 8 and saved["accuracy"]["max_rel_err"] < 1e-2
    assert {r["rows"] for r in saved["timing"]} == set(saved["args"]["rows"])
