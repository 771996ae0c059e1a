"""sgl-deep-gemm 0.1.0 and backends.deepgemm's drop-ins called with the same arguments, on CUDA.

For each 0.1.0 function the drop-ins mirror (``tests/backends/test_deepgemm_parity.py`` holds
the signature table) and each mode (varlen ``indices=``, float32 / bfloat16 logits,
``clean_logits``, compressed ``max_seqlen_k``, fp4): where 0.1.0 computes, our drop-in's
``"auto"`` path must give its bits (it dispatches to deep_gemm) and our reference must agree
(integer schedules bit for bit; logits within the fp8 tolerance of tests/gpu/
test_deepgemm_gpu.py, ``2**-9`` of the magnitude bound, plus one bf16 rounding step for
bf16 logits); shapes, dtypes and row strides must match. Where 0.1.0 refuses on this GPU
(varlen and fp4 are SM100-only), ours must compute the mode with the reference (varlen) and
equal 0.1.0's plain mode where the two coincide, or refuse too (fp4).
Skipped cleanly without CUDA or without an importable deep_gemm.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends import deepgemm  # noqa: E402
from backends.deepgemm import _native  # noqa: E402
from benchmarks.verify.deepgemm import (  # noqa: E402
    LOGITS_TOL,
    abs_inputs,
    make_lens,
    make_logits_inputs,
)
from benchmarks.verify.mqa_logits import make_inputs, sign_cleared  # noqa: E402
from planner.errors import PlanError  # noqa: E402

DG = _native.load()
if DG is None:
    pytest.skip("deep_gemm does not import", allow_module_level=True)

DEV = torch.device("cuda")
SM100 = torch.cuda.get_device_capability()[0] == 10
NUM_SMS = DG.get_num_sms()
BF16_STEP = 2.0**-7  # two roundings to bf16 of nearby fp32 values differ by <= 1 ulp
MQA_TOL = 1e-3  # benchmarks/verify/mqa_logits.py's --tol


def within(got, ref, bound, tol, dtype) -> dict:
    """|got - ref| <= tol * bound (+ one bf16 step of |ref| for bf16) wherever ref is finite."""
    inside = torch.isfinite(ref)
    g, r = got.double()[inside], ref.double()[inside]
    allow = tol * bound.double()[inside]
    if dtype == torch.bfloat16:
        allow = allow + BF16_STEP * r.abs()
    err = (g - r).abs().nan_to_num(nan=float("inf"))
    worst = float((err / allow.clamp(min=1e-30)).max()) if err.numel() else 0.0
    return {"ok": worst <= 1.0, "worst_over_allowed": worst, "checked": int(inside.sum())}


# --- get_paged_mqa_logits_metadata --------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_metadata_same_arguments_same_bits(seed):
    next_n = 1 + seed % 2
    lens = make_lens(17 + 40 * seed, next_n, 30_000, ["uniform", "skewed"][seed % 2], seed).cuda()
    want = DG.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, None)
    for got in (
        deepgemm.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, None),
        deepgemm.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, indices=None),
        deepgemm.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, backend="reference"),
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _varlen(tokens: int, seed: int, paired: bool):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 20_000, (tokens,), generator=g)
    if paired:  # sequences of 1-3 tokens, lengths non-decreasing inside one
        seq = torch.cumsum(torch.rand(tokens, generator=g) < 0.5, 0).to(torch.int32)
        lens = lens[(seq.long() * 20_001 + lens).argsort(stable=True)]
    else:
        seq = torch.arange(tokens, dtype=torch.int32)
    return lens.to(torch.int32).unsqueeze(1).contiguous().cuda(), seq.cuda()


@pytest.mark.parametrize("seed", range(4))
def test_metadata_varlen(seed):
    lens, idx = _varlen(50 + 37 * seed, seed, paired=False)
    ours = deepgemm.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, idx)
    if SM100:
        assert torch.equal(ours, DG.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, idx))
    else:
        with pytest.raises(Exception):  # noqa: B017 - 0.1.0's host assert: arch_major == 10
            DG.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, idx)
    # distinct sequences: the varlen schedule is the plain next_n = 1 one, bit for bit
    assert torch.equal(ours, DG.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS))
    p_lens, p_idx = _varlen(50 + 37 * seed, seed, paired=True)
    p_ours = deepgemm.get_paged_mqa_logits_metadata(p_lens, 64, NUM_SMS, p_idx)
    ref = deepgemm.reference_paged_mqa_schedule(p_lens.cpu(), 64, NUM_SMS, indices=p_idx.cpu())
    assert torch.equal(p_ours.cpu(), ref)
    if SM100:
        assert torch.equal(p_ours, DG.get_paged_mqa_logits_metadata(p_lens, 64, NUM_SMS, p_idx))


# --- fp8_paged_mqa_logits / fp8_fp4_paged_mqa_logits --------------------------------------


def _paged(batch: int, next_n: int, heads: int, seed: int):
    lens = make_lens(batch, next_n, 6000, "uniform", seed)
    q, cache, w, lens, table = make_logits_inputs(batch, next_n, heads, lens, seed, DEV)
    sched = DG.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS)
    return q, cache, w, lens, table, sched, int(lens.max()) + 5


def _paged_bound(q, cache, w, lens, table, sched, width):
    return deepgemm.reference_fp8_paged_mqa_logits(
        *abs_inputs(q, cache, w), lens, table, sched, width
    )


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_logits_same_arguments(next_n, heads, dtype):
    q, *rest = _paged(24, next_n, heads, 3 + heads + next_n)
    lens = rest[2]
    real = DG.fp8_fp4_paged_mqa_logits((q, None), *rest, False, dtype, None)
    auto = deepgemm.fp8_fp4_paged_mqa_logits((q, None), *rest, False, dtype, None)
    ref = deepgemm.fp8_fp4_paged_mqa_logits(
        (q, None), *rest, logits_dtype=dtype, backend="reference"
    )
    for got in (auto, ref):
        assert got.dtype == real.dtype == dtype and got.shape == real.shape
        assert got.stride() == real.stride()
    valid = torch.arange(real.shape[1], device=DEV) < lens.reshape(-1, 1)
    assert torch.equal(auto[valid], real[valid])  # "auto" ran the same kernel
    res = within(real, ref, _paged_bound(q, *rest), LOGITS_TOL, dtype)
    assert res["ok"] and res["checked"] > 0, res
    if dtype == torch.float32:  # the legacy name is the same kernel
        legacy = DG.fp8_paged_mqa_logits(q, *rest, False, None)
        assert torch.equal(legacy[valid], real[valid])
        ours = deepgemm.fp8_paged_mqa_logits(q, *rest, False, None)
        assert torch.equal(ours[valid], real[valid])


def test_paged_logits_varlen():
    q, cache, w, lens, table, _, width = _paged(40, 1, 64, 11)
    idx = torch.arange(40, dtype=torch.int32, device=DEV)
    sched = deepgemm.get_paged_mqa_logits_metadata(lens, 64, NUM_SMS, idx)
    args = (cache, w, lens, table, sched, width)
    ours = deepgemm.fp8_fp4_paged_mqa_logits((q, None), *args, False, torch.float, idx)
    if SM100:
        real = DG.fp8_fp4_paged_mqa_logits((q, None), *args, False, torch.float, idx)
    else:
        with pytest.raises(Exception):  # noqa: B017 - 0.1.0's host assert: arch_major == 10
            DG.fp8_paged_mqa_logits(q, *args, False, idx)
        real = DG.fp8_paged_mqa_logits(q, *args, False)  # distinct sequences: the plain mode
    res = within(real, ours, _paged_bound(q, *args), LOGITS_TOL, torch.float32)
    assert res["ok"] and res["checked"] > 0, res


def _fp4(q: torch.Tensor):
    packed = torch.zeros(*q.shape[:-1], q.shape[-1] // 2, dtype=torch.uint8, device=q.device)
    packed = packed.view(torch.float4_e2m1fn_x2)
    return packed, torch.zeros(q.shape[:-1], dtype=torch.int32, device=q.device)


@pytest.mark.skipif(SM100, reason="fp4 runs on SM100; this checks Hopper's refusal")
def test_fp4_is_refused_by_both():
    q, *rest = _paged(4, 1, 64, 5)
    with pytest.raises(Exception):  # noqa: B017 - 0.1.0: no fp4 on SM90
        DG.fp8_fp4_paged_mqa_logits(_fp4(q), *rest)
    with pytest.raises(Exception):  # noqa: B017 - ours hands fp4 to deep_gemm, which refuses
        deepgemm.fp8_fp4_paged_mqa_logits(_fp4(q), *rest)
    with pytest.raises(PlanError) as e:
        deepgemm.fp8_fp4_paged_mqa_logits(_fp4(q), *rest, backend="reference")
    assert e.value.field == "q"


# --- fp8_mqa_logits / fp8_fp4_mqa_logits --------------------------------------------------


RAGGED = [
    dict(tokens=300, kv_tokens=2000, heads=64, kind="causal", seed=21, extra_width=0),
    dict(tokens=129, kv_tokens=777, heads=32, kind="random", seed=22, extra_width=0),
]


@pytest.mark.parametrize("case", RAGGED, ids=["causal-h64", "random-h32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["plain", "clean", "compressed"])
def test_mqa_logits_same_arguments(case, dtype, mode):
    inp = make_inputs(case, DEV)
    q, kv, w, ks, ke = (inp[k] for k in ("q", "kv", "weights", "ks", "ke"))
    clean = mode == "clean"
    width = int((ke - ks).max()) + 3 if mode == "compressed" else 0
    real = DG.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean, width, dtype)
    auto = deepgemm.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean, width, dtype)
    ref = deepgemm.fp8_fp4_mqa_logits(
        (q, None), kv, w, ks, ke, clean, width, dtype, backend="reference"
    )
    for got in (auto, ref):
        assert got.dtype == real.dtype == dtype and got.shape == real.shape
        assert got.stride() == real.stride()
    inside = torch.isfinite(ref)
    assert torch.equal(auto[inside], real[inside])
    bound = deepgemm.fp8_fp4_mqa_logits(
        (sign_cleared(q), None), (sign_cleared(kv[0]), kv[1].abs()), w.abs(), ks, ke,
        False, width, backend="reference",
    )  # fmt: skip
    res = within(real, ref, bound, MQA_TOL, dtype)
    assert res["ok"] and res["checked"] > 0, res
    if clean:
        assert bool((real[~inside] == float("-inf")).all())
    if dtype == torch.float32:  # the legacy name is the same kernel
        legacy = DG.fp8_mqa_logits(q, kv, w, ks, ke, clean, width)
        assert torch.equal(legacy[inside], real[inside])
        ours = deepgemm.fp8_mqa_logits(q, kv, w, ks, ke, clean, width)
        assert torch.equal(ours[inside], real[inside])
