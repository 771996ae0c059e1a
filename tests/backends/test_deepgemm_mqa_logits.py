"""CPU tests of the ragged ``fp8_mqa_logits`` drop-in and its reference.

The reference is checked bit for bit against a plain float64 loop (its dot products are
exact and its heads accumulate in order, so equality, not closeness, is the contract),
against exact integer dot products at extreme fp8 magnitudes, and for its layouts: -inf
outside every range, the compressed layout equal to the uncompressed one shifted, the
kernel's row strides. Dispatch is checked with a tensor that claims to live on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.deepgemm import (
    _native,
    fp8_mqa_logits,
    mqa_logits_row_stride,
    reference_fp8_mqa_logits,
    validate_mqa_logits_inputs,
)
from backends.deepgemm import mqa_logits as mqa_mod
from planner.errors import PlanError, ProviderError
from tests.support import REPO

E4M3 = torch.float8_e4m3fn
I32 = torch.int32
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ["random", "causal", "full", "empty", "window"]


def make_ranges(tokens: int, kv_tokens: int, kind: str, gen: torch.Generator):
    """int32 ``(ks, ke)`` with ``0 <= ks <= ke <= kv_tokens``."""
    if kind == "full":
        ks = torch.zeros(tokens, dtype=torch.int64)
        ke = torch.full((tokens,), kv_tokens, dtype=torch.int64)
    elif kind == "causal":  # request-major prefill: row i of a request ends at prefix + i + 1
        ks, ke, start, row = [], [], 0, 0
        while row < tokens:
            left = kv_tokens - start
            if left <= 0:
                start, left = 0, kv_tokens  # reuse the KV: ranges only need to be valid
            ext = int(torch.randint(1, min(tokens - row, left) + 1, (1,), generator=gen))
            prefix = int(torch.randint(0, left - ext + 1, (1,), generator=gen))
            for i in range(ext):
                ks.append(start)
                ke.append(start + prefix + i + 1)
            start, row = start + prefix + ext, row + ext
        ks, ke = torch.tensor(ks), torch.tensor(ke)
    elif kind == "window":
        ke = torch.randint(1, kv_tokens + 1, (tokens,), generator=gen)
        ks = (ke - torch.randint(1, 9, (tokens,), generator=gen)).clamp(min=0)
    else:
        a = torch.randint(0, kv_tokens + 1, (tokens,), generator=gen)
        b = torch.randint(0, kv_tokens + 1, (tokens,), generator=gen)
        ks, ke = torch.minimum(a, b), torch.maximum(a, b)
        if kind == "empty":
            ke = torch.where(torch.rand(tokens, generator=gen) < 0.5, ks, ke)
    return ks.to(I32), ke.to(I32)


def fp8_values(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """e4m3 values over the whole exponent range, subnormals and +-448 included."""
    x = torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-10, 9, shape, generator=gen)
    return x.clamp(-448, 448).to(E4M3)


def make_case(tokens: int, kv_tokens: int, heads: int, dim: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = fp8_values(g, tokens, heads, dim)
    k = fp8_values(g, kv_tokens, dim)
    k_scale = torch.rand(kv_tokens, generator=g) * 2.0 ** torch.randint(-12, 4, (kv_tokens,))
    weights = torch.randn(tokens, heads, generator=g) * 0.1
    ks, ke = make_ranges(tokens, kv_tokens, kind, g)
    return q, (k, k_scale), weights, ks, ke


def plain_loop(q, kv, weights, ks, ke) -> torch.Tensor:
    """The formula row by row in Python floats (float64), heads in order, -inf elsewhere."""
    k, k_scale = kv
    tokens, heads, _ = q.shape
    out = torch.full((tokens, k.shape[0]), float("-inf"), dtype=torch.float64)
    k64 = k.double()
    for r in range(tokens):
        dots = (q[r].double() @ k64.T).tolist()  # exact: see the module docstring
        w = weights[r].double().tolist()
        for t in range(int(ks[r]), int(ke[r])):
            acc = 0.0
            for h in range(heads):
                acc += w[h] * max(dots[h][t], 0.0)
            out[r, t] = acc * float(k_scale[t])
    return out.float()


# --------------------------------------------------------------------------- values


@FAST
@given(
    tokens=st.integers(1, 12),
    kv_tokens=st.integers(1, 40),
    heads=st.sampled_from([1, 3, 8]),
    dim=st.sampled_from([16, 128]),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_equals_a_plain_float64_loop(tokens, kv_tokens, heads, dim, kind, seed):
    case = make_case(tokens, kv_tokens, heads, dim, kind, seed)
    got = reference_fp8_mqa_logits(*case)
    assert got.shape == (tokens, kv_tokens) and got.dtype == torch.float32
    assert torch.equal(got, plain_loop(*case))
    assert torch.equal(fp8_mqa_logits(*case), got)  # CPU dispatch is the reference


def test_dot_products_are_exact_at_extreme_magnitudes():
    """H = 1, weight 1, scale 1: each logit is relu(q . k) rounded once to float32."""
    values = torch.tensor([448.0, -448.0, 2.0**-9, -(2.0**-9), 0.0, 1.0, 3.0, -0.875]).to(E4M3)
    g = torch.Generator().manual_seed(1)
    q = values[torch.randint(0, 8, (6, 1, 128), generator=g)]
    k = values[torch.randint(0, 8, (50, 128), generator=g)]
    ks, ke = torch.zeros(6, dtype=I32), torch.full((6,), 50, dtype=I32)
    got = reference_fp8_mqa_logits(q, (k, torch.ones(50)), torch.ones(6, 1), ks, ke)
    units_q = (q.double() * 2**9).long()[:, 0]  # every e4m3 value is an integer * 2**-9
    units_k = (k.double() * 2**9).long()
    exact = [[max(int((a * b).sum()), 0) * 2.0**-18 for b in units_k] for a in units_q]
    assert torch.equal(got, torch.tensor(exact, dtype=torch.float64).float())


@pytest.mark.parametrize("kind", KINDS)
def test_minus_inf_outside_the_ranges_with_or_without_clean(kind):
    case = make_case(30, 70, 4, 128, kind, seed=3)
    _, _, _, ks, ke = case
    plain = reference_fp8_mqa_logits(*case, False)
    clean = reference_fp8_mqa_logits(*case, True)
    assert torch.equal(plain, clean)
    cols = torch.arange(70)
    inside = (cols >= ks[:, None].long()) & (cols < ke[:, None].long())
    assert torch.isfinite(plain[inside]).all()
    assert (plain[~inside] == float("-inf")).all()


@FAST
@given(
    tokens=st.integers(1, 16),
    kv_tokens=st.integers(1, 300),
    extra=st.sampled_from([0, 1, 255, 300]),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_compressed_layout_is_the_uncompressed_one_shifted(tokens, kv_tokens, extra, kind, seed):
    case = make_case(tokens, kv_tokens, 4, 32, kind, seed)
    _, _, _, ks, ke = case
    width = int((ke - ks).max()) + extra
    if width == 0:
        width = 1  # max_seqlen_k = 0 means "not compressed"
    full = reference_fp8_mqa_logits(*case)
    comp = reference_fp8_mqa_logits(*case, False, width)
    assert comp.shape == (tokens, width)
    for r in range(tokens):
        n = int(ke[r] - ks[r])
        assert torch.equal(comp[r, :n], full[r, int(ks[r]) : int(ke[r])])
        assert (comp[r, n:] == float("-inf")).all()


@pytest.mark.parametrize(
    ("kv_tokens", "max_seqlen_k"), [(1, 0), (7, 0), (300, 0), (300, 1), (40, 257)]
)
def test_result_is_the_kernels_strided_view(kv_tokens, max_seqlen_k):
    case = make_case(5, kv_tokens, 2, 32, "full" if max_seqlen_k == 0 else "window", seed=4)
    if max_seqlen_k:
        case = (*case[:3], case[4] - 1, case[4])  # one token per row: fits any width
    got = reference_fp8_mqa_logits(*case, False, max_seqlen_k)
    want = (-(-(kv_tokens + 256) // 8)) * 8 if max_seqlen_k == 0 else -(-max_seqlen_k // 256) * 256
    assert got.stride() == (want, 1) == (mqa_logits_row_stride(kv_tokens, max_seqlen_k), 1)
    assert not got.is_contiguous()


def test_chunking_does_not_change_a_bit(monkeypatch):
    case = make_case(9, 123, 5, 128, "causal", seed=5)
    whole = reference_fp8_mqa_logits(*case)
    whole_c = reference_fp8_mqa_logits(*case, False, 130)
    monkeypatch.setattr(mqa_mod, "_CHUNK_ELEMENTS", 1)  # one column at a time
    assert torch.equal(reference_fp8_mqa_logits(*case), whole)
    assert torch.equal(reference_fp8_mqa_logits(*case, False, 130), whole_c)


def test_empty_shapes():
    case = make_case(1, 5, 2, 32, "full", seed=6)
    q, kv, w, ks, ke = case
    assert reference_fp8_mqa_logits(q[:0], kv, w[:0], ks[:0], ke[:0]).shape == (0, 5)
    none = (kv[0][:0], kv[1][:0])
    got = reference_fp8_mqa_logits(q, none, w, ks * 0, ke * 0)
    assert got.shape == (1, 0)


def test_unchecked_values_stay_defined():
    """check_values=False (CUDA, capture): out-of-range KV is clamped then masked, never read."""
    q, kv, w, _, _ = make_case(3, 10, 2, 32, "full", seed=7)
    ks = torch.tensor([-5, 8, 9], dtype=I32)
    ke = torch.tensor([2, 30, 9], dtype=I32)
    got = reference_fp8_mqa_logits(q, kv, w, ks, ke, check_values=False)
    assert torch.isfinite(got[0, :2]).all() and torch.isinf(got[0, 2:]).all()
    assert torch.isfinite(got[1, 8:]).all() and torch.isinf(got[1, :8]).all()
    assert torch.isinf(got[2]).all()
    comp = reference_fp8_mqa_logits(q, kv, w, ks, ke, False, 4, check_values=False)
    assert torch.isfinite(comp[1, :2]).all() and torch.isinf(comp[1, 2:]).all()  # past kv_tokens
    assert torch.equal(comp[1, :2], got[1, 8:])


# --------------------------------------------------------------------------- validation


def _bad_cases():
    q, (k, s), w, ks, ke = make_case(4, 20, 2, 32, "random", seed=8)
    ks, ke = torch.tensor([0, 1, 2, 3], dtype=I32), torch.tensor([5, 6, 7, 20], dtype=I32)
    good = dict(q=q, kv=(k, s), weights=w, ks=ks, ke=ke)
    meta_k = torch.empty(20, 32, dtype=E4M3, device="meta")
    return good, [
        ("q dtype", dict(q=q.float()), "q"),
        ("q rank", dict(q=q[:, 0]), "q"),
        ("q strided", dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)), "q"),
        ("kv not a pair", dict(kv=k), "kv"),
        ("k dtype", dict(kv=(k.float(), s)), "k"),
        ("k head dim", dict(kv=(k[:, :16].contiguous(), s)), "k"),
        ("k strided", dict(kv=(k.t().contiguous().t(), s)), "k"),
        ("k_scale 2-D", dict(kv=(k, s[:, None])), "k_scale"),
        ("k_scale length", dict(kv=(k, s[:19])), "k_scale"),
        ("k_scale dtype", dict(kv=(k, s.double())), "k_scale"),
        ("weights tokens", dict(weights=w[:3]), "weights"),
        ("weights heads", dict(weights=w[:, :1]), "weights"),
        ("weights strided", dict(weights=w.t().contiguous().t()), "weights"),
        ("ks dtype", dict(ks=ks.long()), "ks"),
        ("ks tokens", dict(ks=ks[:3]), "ks"),
        ("ke rank", dict(ke=ke[:, None]), "ke"),
        ("ke strided", dict(ke=torch.stack([ke, ke], 1)[:, 0]), "ke"),
        ("ks > ke", dict(ks=torch.tensor([0, 7, 2, 3], dtype=I32)), "ks"),
        ("negative ks", dict(ks=torch.tensor([-1, 1, 2, 3], dtype=I32)), "ks"),
        ("ke past kv_tokens", dict(ke=torch.tensor([5, 6, 7, 21], dtype=I32)), "ke"),
        ("devices", dict(kv=(meta_k, s)), "q"),
        ("clean bool", dict(clean_logits=1), "clean_logits"),
        ("compressed too narrow", dict(max_seqlen_k=16), "max_seqlen_k"),
        ("compressed negative", dict(max_seqlen_k=-1), "max_seqlen_k"),
        ("compressed bool", dict(max_seqlen_k=True), "max_seqlen_k"),
        ("compressed and clean", dict(max_seqlen_k=17, clean_logits=True), "clean_logits"),
    ]


GOOD, BAD = _bad_cases()


@pytest.mark.parametrize(("name", "change", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_field(name, change, field):
    args = GOOD | change
    for fn in (reference_fp8_mqa_logits, fp8_mqa_logits):
        with pytest.raises(PlanError) as e:
            fn(**args)
        assert e.value.field == field, (name, str(e.value))
    fine = GOOD | {"max_seqlen_k": 17}  # the widest row (ke - ks = 17) fits
    assert reference_fp8_mqa_logits(**fine).shape == (4, 17)


def test_value_checks_can_be_skipped_and_asked_for():
    bad = GOOD | {"ke": torch.tensor([5, 6, 7, 21], dtype=I32)}
    validate_mqa_logits_inputs(**bad)  # shapes only by default
    with pytest.raises(PlanError) as e:
        validate_mqa_logits_inputs(**bad, check_values=True)
    assert e.value.field == "ke" and "row 3" in str(e.value)
    assert validate_mqa_logits_inputs(**GOOD) == (4, 20, 2, 32)


# --------------------------------------------------------------------------- dispatch


class ClaimsCuda(torch.Tensor):
    """A CPU tensor whose ``is_cuda`` says True: drives the CUDA branch of the dispatch."""

    @property
    def is_cuda(self) -> bool:
        return True


def _on_fake_cuda(args: dict) -> dict:
    return args | {"q": args["q"].as_subclass(ClaimsCuda)}


def test_cpu_dispatch_is_the_reference_and_never_loads_deep_gemm(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: pytest.fail("loaded deep_gemm for CPU tensors"))
    assert torch.equal(fp8_mqa_logits(**GOOD), reference_fp8_mqa_logits(**GOOD))
    with pytest.raises(ProviderError) as e:
        fp8_mqa_logits(**GOOD, backend="native")
    assert e.value.field == "backend"
    with pytest.raises(PlanError) as e:
        fp8_mqa_logits(**GOOD, backend="deep_gemm")
    assert e.value.field == "backend"


def test_cuda_dispatch_falls_back_to_the_reference_without_deep_gemm(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: None)
    args = _on_fake_cuda(GOOD)
    got = fp8_mqa_logits(**args)
    assert torch.equal(got.as_subclass(torch.Tensor), reference_fp8_mqa_logits(**GOOD))
    with pytest.raises(ProviderError) as e:
        fp8_mqa_logits(**args, backend="native")
    assert e.value.field == "backend"
    with pytest.raises(PlanError) as e:  # shapes are still checked before the fallback
        fp8_mqa_logits(**(args | {"weights": GOOD["weights"][:3]}))
    assert e.value.field == "weights"


def test_cuda_dispatch_hands_deep_gemm_its_own_argument_order(monkeypatch):
    calls = []

    def kernel(*args):
        calls.append(args)
        return "from deep_gemm"

    monkeypatch.setattr(_native, "load", lambda: SimpleNamespace(fp8_mqa_logits=kernel))
    args = _on_fake_cuda(GOOD)
    assert fp8_mqa_logits(**args, clean_logits=True) == "from deep_gemm"
    assert fp8_mqa_logits(**args, max_seqlen_k=32) == "from deep_gemm"
    q, kv, w, ks, ke, clean, width = calls[0]
    assert q is args["q"] and isinstance(kv, tuple) and kv[0] is GOOD["kv"][0]
    assert w is GOOD["weights"] and ks is GOOD["ks"] and ke is GOOD["ke"]
    assert (clean, width) == (True, 0) and calls[1][5:] == (False, 32)
    assert torch.equal(
        fp8_mqa_logits(**args, backend="reference"), reference_fp8_mqa_logits(**GOOD)
    )
    assert len(calls) == 2


# --------------------------------------------------------------------------- GPU script


def test_gpu_verification_script_smoke_mode(tmp_path):
    """The script the lead runs on the H200, with the reference standing in for the kernel."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)  # keep the device's /tmp/site (pydantic)
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "mqa_logits", "--smoke", "--cases", "6"]
        + ["--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "overall: OK" in run.stdout
    assert (tmp_path / "verify_mqa_logits.json").exists()


def _load_script():
    from benchmarks.verify import mqa_logits

    return mqa_logits


def test_gpu_verification_script_catches_broken_kernels():
    """Each check of the script fails for the kernel bug it exists to catch."""
    script = _load_script()
    case = dict(tokens=24, kv_tokens=200, heads=32, kind="causal", seed=8, extra_width=1)
    cpu = torch.device("cpu")

    def ref(*a):
        return fp8_mqa_logits(*a, backend="reference")

    def noisy(*a):  # a 1 % error on every value
        return ref(*a) * 1.01

    def unclean(*a):  # clean_logits ignored: the real scores leak outside the ranges
        q, kv, w, ks, ke, _, width = a
        full = (0 * ks, torch.full_like(ke, kv[0].shape[0])) if width == 0 else (ks, ke)
        return ref(q, kv, w, *full, False, width)

    def misplaced(*a):  # compressed rows start at column ks instead of 0
        q, kv, w, ks, ke, clean, width = a
        out = ref(*a)
        return ref(q, kv, w, ks, ke, clean, 0)[:, :width] if width else out

    good = script.run_case(case, ref, cpu, 1e-3)
    assert all(good[s]["ok"] for s in ("plain", "clean", "compressed"))
    bad = script.run_case(case, noisy, cpu, 1e-3)
    assert not any(bad[s]["ok"] for s in ("plain", "clean", "compressed"))
    assert 9e-3 < bad["plain"]["rel_err"] < 1.1e-2 and bad["plain"]["err_over_bound"] < 1e-3
    bad = script.run_case(case, unclean, cpu, 1e-3)
    assert bad["plain"]["ok"] and not bad["clean"]["ok"]
    assert not bad["clean"]["outside_all_neg_inf"]
    bad = script.run_case(case, misplaced, cpu, 1e-3)
    assert bad["plain"]["ok"] and not bad["compressed"]["ok"]
    assert script.compressed_clean(case, ref, cpu)["rejected"]
