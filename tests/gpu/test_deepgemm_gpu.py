"""Real deep_gemm (sgl-deep-gemm 0.1.0) against the backends.deepgemm references, on CUDA.

Skipped cleanly without CUDA; the tests that call deep_gemm are skipped when it does not
import. The case generators and checks are those of ``benchmarks/verify/deepgemm.py``
(one source of truth), here over a smaller sweep. Expect ~1-2 s of JIT compilation per
new (batch bucket, num_sms) for the metadata kernel and per (next_n, heads) for the
logits kernel on a cold cache.
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
    check_logits,
    check_schedule,
    graph_checks,
    logits_cases,
    make_lens,
    make_logits_inputs,
    schedule_cases,
)

DG = _native.load()
DEV = torch.device("cuda")
needs_dg = pytest.mark.skipif(DG is None, reason="deep_gemm does not import")


def _sid(c: dict) -> str:
    return f"b{c['batch']}-n{c['next_n']}-sm{c['num_sms']}-{c['kind']}-{c['max_len']}"


def _lid(c: dict) -> str:
    return f"b{c['batch']}-n{c['next_n']}-h{c['heads']}-{c['kind']}-{c['max_len']}"


SCHED_CASES = schedule_cases(160, seed=7)
LOGITS_CASES = logits_cases(16, seed=7)


@needs_dg
def test_installed_build_is_the_documented_layout():
    assert _native.native_schedule_layout() == "0.1.0"
    assert DG.get_num_sms() == torch.cuda.get_device_properties(0).multi_processor_count


@needs_dg
@pytest.mark.parametrize("case", SCHED_CASES, ids=[_sid(c) for c in SCHED_CASES])
def test_schedule_bit_equal(case):
    res = check_schedule(case, DG.get_paged_mqa_logits_metadata, DEV)
    assert res["ok"], res


@needs_dg
def test_schedule_sweep_saw_both_layouts_differ():
    """The sweep is only meaningful if it has cases where 0.1.0 and 'new' disagree."""
    differ = [
        check_schedule(c, DG.get_paged_mqa_logits_metadata, DEV)["layouts_differ"]
        for c in SCHED_CASES[:40]
    ]
    assert sum(differ) >= 10


@needs_dg
@pytest.mark.parametrize("case", LOGITS_CASES, ids=[_lid(c) for c in LOGITS_CASES])
def test_logits_within_fp8_tolerance(case):
    torch.cuda.empty_cache()
    res = check_logits(case, DG.fp8_paged_mqa_logits, DEV)
    assert res["ok"], res
    assert res["rows_cover_last_len"], res  # both MTP rows run over the last column's length


@needs_dg
def test_dispatch_uses_the_real_kernels():
    lens = make_lens(77, 2, 9000, "uniform", 1)
    got = deepgemm.get_paged_mqa_logits_metadata(lens.cuda(), 64, 132, backend="native")
    assert torch.equal(got.cpu(), deepgemm.reference_paged_mqa_schedule(lens, 64, 132))
    q, cache, w, lens_d, table = make_logits_inputs(77, 2, 64, lens, 1, DEV)
    out = deepgemm.fp8_paged_mqa_logits(q, cache, w, lens_d, table, got, 9000, backend="native")
    assert out.shape == (154, 9000) and out.dtype == torch.float32


def test_references_on_cuda_equal_cpu():
    lens = make_lens(300, 2, 70_000, "skewed", 3)
    for layout in ("0.1.0", "new"):
        on_gpu = deepgemm.reference_paged_mqa_schedule(lens.cuda(), 64, 132, layout)
        assert torch.equal(
            on_gpu.cpu(), deepgemm.reference_paged_mqa_schedule(lens, 64, 132, layout)
        )
    small = make_lens(4, 2, 700, "uniform", 4)
    gpu_in = make_logits_inputs(4, 2, 32, small, 4, DEV)
    cpu_in = [t.cpu() for t in gpu_in]
    sched = deepgemm.reference_paged_mqa_schedule(small, 64, 132)
    a = deepgemm.reference_fp8_paged_mqa_logits(*gpu_in, sched.cuda(), 800)
    b = deepgemm.reference_fp8_paged_mqa_logits(*cpu_in, sched, 800)
    scale = float(b[torch.isfinite(b)].abs().max())  # fp32 sums in another order
    torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5 * scale)


def test_cuda_graph_capture_and_replay():
    results = graph_checks(DEV, DG)
    assert results and all(r["ok"] for r in results), results


@needs_dg
def test_ragged_logits_with_empty_ranges():
    """The extend indexer empties the score range of every token whose KV fits in top-k.
    The real ``fp8_mqa_logits`` (compressed layout) must then leave the other rows exactly
    as they are with every range full, and those rows must match the reference."""
    g = torch.Generator(device=DEV).manual_seed(11)
    tokens, heads, dim, kv_tokens, width = 192, 64, 128, 6000, 2500
    q = torch.randn(tokens, heads, dim, generator=g, device=DEV).to(torch.float8_e4m3fn)
    keys = torch.randn(kv_tokens, dim, generator=g, device=DEV).to(torch.float8_e4m3fn)
    scales = torch.rand(kv_tokens, generator=g, device=DEV) + 0.5
    w = torch.randn(tokens, heads, generator=g, device=DEV)
    ks = torch.randint(0, kv_tokens - width, (tokens,), generator=g, device=DEV).int()
    ke = ks + torch.randint(1, width + 1, (tokens,), generator=g, device=DEV).int()
    empty = torch.rand(tokens, generator=g, device=DEV) < 0.5
    empty[:64] = True  # a whole block of empty rows, as a decode block that fits top-k
    ke_some = torch.where(empty, ks, ke)
    full = deepgemm.fp8_mqa_logits(q, (keys, scales), w, ks, ke, False, width, backend="native")
    some = deepgemm.fp8_mqa_logits(
        q, (keys, scales), w, ks, ke_some, False, width, backend="native"
    )
    ref = deepgemm.reference_fp8_mqa_logits(q, (keys, scales), w, ks, ke, False, width)
    valid = torch.arange(width, device=DEV)[None, :] < (ke - ks)[:, None]
    kept = valid & ~empty[:, None]
    assert int(kept.sum()) > 0
    assert torch.equal(some[kept], full[kept])
    # Within the verified kernels' tolerance of the magnitude bound (all terms positive).
    fp8 = torch.float8_e4m3fn
    q_abs, k_abs = q.float().abs().to(fp8), keys.float().abs().to(fp8)
    bound = deepgemm.reference_fp8_mqa_logits(q_abs, (k_abs, scales), w.abs(), ks, ke, False, width)
    err = (full[valid] - ref[valid]).abs()
    assert bool((err <= LOGITS_TOL * bound[valid] + 1e-6).all()), float(err.max())
