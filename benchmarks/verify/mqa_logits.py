#!/usr/bin/env python3
"""Compare backends.deepgemm's ragged ``fp8_mqa_logits`` reference with the real kernel.

Run on the CUDA machine with sgl-deep-gemm 0.1.0 (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks mqa_logits --out "$OUT"

Over random ragged batches (tokens 1..4096, kv_tokens 1..16384, H 32 and 64, D 128; KV
ranges from the causal prefill pattern ``ks = start of request, ke = start + pos + 1``,
random, full, empty rows, short windows), each case calls the kernel four ways:

* ``plain``: values inside ``[ks, ke)`` vs the reference, through two gates, each failing
  above ``--tol`` (1e-3): the relative error ``||got - ref|| / ||ref||`` (2-norm over the
  case's valid entries; DEVICE.md measured ~2e-4), and the largest element-wise error over
  the magnitude bound ``k_scale * sum_h |w_h| * (|q_h| . |k|)`` (the reference over
  sign-cleared inputs), which bounds every rounding error, so it cannot blow up where heads
  cancel to ~0, and it catches local gross errors the norm would average away. Reported
  too (informative): the row-wise ``max|err| / max|ref|`` and the element-wise
  ``|err| / |ref|`` over entries not cancelled below 1e-3 of their row's maximum.
* ``clean``: ``clean_logits=True``: exactly ``-inf`` outside ``[ks, ke)``, values inside as
  above (and whether they are bit-equal to ``plain``'s).
* ``compressed``: ``max_seqlen_k = max(ke - ks) + extra``: row ``r`` holds KV ``ks[r]..``
  from column 0; columns below ``ke - ks`` checked as above (expected values are the
  reference shifted; every 8th case also runs the reference's compressed path and requires
  it to equal the shifted one bit for bit).
* ``compressed_clean``: 0.1.0 rejects ``clean_logits`` with ``max_seqlen_k > 0`` (a host
  assert), and so does the drop-in. Recorded for the first few cases: a rejection passes;
  an acceptance passes only with ``-inf`` past ``ke - ks`` and is flagged.

The result strides (the reference reproduces ``align(kv_tokens + 256, 8)`` and
``align(max_seqlen_k, 256)``) are recorded too. Prints a table, writes
``verify_mqa_logits.json`` under ``--out``, exits 1 on any failure. Without CUDA and
deep_gemm it stops with exit 2, unless ``--smoke`` is given: small cases on the CPU with the
reference standing in for the kernel (tests/backends/test_deepgemm_mqa_logits.py runs that).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from backends.deepgemm import (
    _native,
    fp8_mqa_logits,
    mqa_logits_row_stride,
    quantize_fp8_e4m3_per_vector,
    reference_fp8_mqa_logits,
)

GPU_STEPS = {
    "": "--out {out}",
}

KINDS = ["causal", "causal", "random", "full", "empty", "window"]
NEG_INF = float("-inf")

# --------------------------------------------------------------------------- cases
# KV ranges follow the causal prefill pattern (``ks`` = start of the request, ``ke`` = start
# + position + 1) most of the time, with random, full, empty and short-window rows mixed in;
# every case carries its own seed so a failure can be rerun alone.


def causal_ranges(tokens: int, kv_cap: int, rng: random.Random) -> tuple[list[int], list[int], int]:
    """Request-major extend batch: request b's rows read ``[start_b, start_b + prefix_b + i + 1)``."""
    ks: list[int] = []
    ke: list[int] = []
    start = 0
    while len(ks) < tokens:
        left = tokens - len(ks)
        ext = rng.randint(1, left) if rng.random() < 0.3 else rng.randint(1, max(1, left // 4))
        spare = kv_cap - start - left  # >= 0: every later token still needs one KV token
        prefix = rng.randint(0, spare) if rng.random() < 0.7 else 0
        for i in range(ext):
            ks.append(start)
            ke.append(start + prefix + i + 1)
        start += prefix + ext
    return ks, ke, start


def make_ranges(
    tokens: int, kv_tokens: int, kind: str, rng: random.Random
) -> tuple[list[int], list[int]]:
    if kind == "full":
        return [0] * tokens, [kv_tokens] * tokens
    if kind == "window":
        ke = [rng.randint(1, kv_tokens) for _ in range(tokens)]
        width = rng.choice([1, 2, 3, 64, 257, 2048])
        return [max(0, e - width) for e in ke], ke
    ks, ke = [], []
    for _ in range(tokens):
        a, b = sorted((rng.randint(0, kv_tokens), rng.randint(0, kv_tokens)))
        if kind == "empty" and rng.random() < 0.3:
            b = a
        ks.append(a)
        ke.append(b)
    return ks, ke


def cases(n: int, seed: int, max_tokens: int, max_kv: int) -> list[dict[str, Any]]:
    """Edge cases first (clipped to the limits), then random ones."""
    rng = random.Random(seed)
    edge = [
        dict(tokens=1, kv_tokens=1, heads=64, kind="full"),
        dict(tokens=max_tokens, kv_tokens=max_kv, heads=64, kind="causal"),
        dict(tokens=3, kv_tokens=5, heads=32, kind="random"),  # tokens % (128 // H) != 0
        dict(tokens=max_tokens, kv_tokens=max_tokens, heads=32, kind="causal"),
        dict(tokens=1, kv_tokens=max_kv, heads=32, kind="full"),
        dict(tokens=257, kv_tokens=1000, heads=64, kind="window"),
        dict(tokens=100, kv_tokens=777, heads=64, kind="empty"),
        dict(tokens=2048, kv_tokens=300, heads=32, kind="random"),  # fewer KV than rows
    ]
    out = [
        c | dict(tokens=min(c["tokens"], max_tokens), kv_tokens=min(c["kv_tokens"], max_kv))
        for c in edge
    ]
    while len(out) < n:
        tokens = rng.randint(1, max_tokens) if rng.random() < 0.7 else rng.randint(1, 64)
        out.append(
            dict(
                tokens=tokens,
                kv_tokens=rng.randint(1, max_kv),
                heads=rng.choice([32, 64]),
                kind=rng.choice(KINDS),
            )
        )
    for i, c in enumerate(out):
        c["seed"] = seed * 100_003 + i
        c["extra_width"] = rng.choice([0, 0, 1, 100])
    return out[:n]


def make_inputs(case: dict[str, Any], device: torch.device, dim: int = 128) -> dict[str, Any]:
    """q, (k, k_scale), weights (q's scale folded in, as DeepSeek-V3.2 does), ks, ke."""
    rng = random.Random(case["seed"])
    tokens, kv_tokens = case["tokens"], case["kv_tokens"]
    if case["kind"] == "causal":
        extra = rng.choice([0, 0, 1, 300])  # a static KV capacity past the real KV
        ks, ke, used = causal_ranges(tokens, max(kv_tokens - extra, tokens), rng)
        kv_tokens = used + extra
    else:
        ks, ke = make_ranges(tokens, kv_tokens, case["kind"], rng)
    g = torch.Generator(device=device).manual_seed(case["seed"])
    keys = torch.randn(kv_tokens, dim, generator=g, device=device)
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(keys)
    k_scale = (
        k_scale[:, 0] * (torch.rand(kv_tokens, generator=g, device=device) + 0.05)
    ).contiguous()
    q = torch.randn(tokens, case["heads"], dim, generator=g, device=device)
    q_fp8, q_scale = quantize_fp8_e4m3_per_vector(q)
    weights = torch.randn(tokens, case["heads"], generator=g, device=device) * q_scale[..., 0]
    return dict(
        q=q_fp8,
        kv=(k_fp8, k_scale),
        weights=weights.contiguous(),
        ks=torch.tensor(ks, dtype=torch.int32, device=device),
        ke=torch.tensor(ke, dtype=torch.int32, device=device),
        kv_tokens=kv_tokens,
    )


# --------------------------------------------------------------------------- checks
# One case, the kernel called four ways: ``plain``, ``clean`` (``-inf`` outside the range),
# ``compressed`` (row ``r`` from column 0) and, for a few cases, ``compressed_clean`` (which
# 0.1.0 rejects). Each is gated on the relative error and on the error over the magnitude
# bound (the reference over sign-cleared inputs), which bounds every rounding error where
# heads cancel.


def sign_cleared(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` of an fp8 e4m3 tensor (the sign bit cleared): inputs of the magnitude bound."""
    return (x.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def compare(
    got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, inside: torch.Tensor, tol: float
) -> dict[str, Any]:
    """Errors of ``got`` against ``ref`` where ``inside``, and whether both gates pass."""
    res = dict(rel_err=0.0, err_over_bound=0.0, row_rel=0.0, elem_rel=0.0, nonfinite_inside=0)
    if not bool(inside.any()):
        return res | dict(ok=True)
    zero = torch.zeros((), device=got.device, dtype=torch.float64)
    err = torch.where(inside, (got.double() - ref.double()).abs(), zero)
    err = err.nan_to_num(nan=float("inf"))
    ref_abs = torch.where(inside, ref.double().abs(), zero)
    norm_ref = float(ref_abs.square().sum().sqrt())
    norm_err = float(err.square().sum().sqrt())
    res["rel_err"] = norm_err / norm_ref if norm_ref > 0 else (0.0 if norm_err == 0 else 1e30)
    ratio = torch.where(inside, err / bound.double().clamp(min=1e-30), zero)
    res["err_over_bound"] = float(ratio.max())
    row_max = ref_abs.amax(dim=1, keepdim=True)
    rows = row_max[:, 0] > 0
    if bool(rows.any()):
        res["row_rel"] = float((err.amax(dim=1, keepdim=True)[rows] / row_max[rows]).max())
    big = inside & (ref_abs >= 1e-3 * row_max) & (ref_abs > 0)
    if bool(big.any()):
        res["elem_rel"] = float((err[big] / ref_abs[big]).max())
    res["nonfinite_inside"] = int((inside & ~torch.isfinite(got)).sum())
    res["ok"] = (
        res["nonfinite_inside"] == 0 and res["rel_err"] <= tol and res["err_over_bound"] <= tol
    )
    return res


def shifted(full: torch.Tensor, ks: torch.Tensor, width: int) -> torch.Tensor:
    """The compressed layout of an uncompressed ``full``: column j of row r is ``ks[r] + j``."""
    idx = ks.long().unsqueeze(1) + torch.arange(width, device=full.device)
    return full.gather(1, idx.clamp(max=max(full.shape[1] - 1, 0)))


def run_case(
    case: dict[str, Any], kernel: Callable[..., torch.Tensor], device: torch.device, tol: float
) -> dict[str, Any]:
    inp = make_inputs(case, device)
    q, kv, w, ks, ke, n_kv = (inp[k] for k in ("q", "kv", "weights", "ks", "ke", "kv_tokens"))
    tokens = q.shape[0]
    args = (q, kv, w, ks, ke)
    ref = reference_fp8_mqa_logits(*args)
    bound = reference_fp8_mqa_logits(
        sign_cleared(q), (sign_cleared(kv[0]), kv[1].abs()), w.abs(), ks, ke
    )
    cols = torch.arange(n_kv, device=device)
    inside = (cols >= ks.long()[:, None]) & (cols < ke.long()[:, None])
    res: dict[str, Any] = dict(case, kv_tokens=n_kv, max_range=int((ke - ks).max()))

    got = kernel(*args, False, 0)
    plain = compare(got, ref, bound, inside, tol)
    plain["shape_ok"] = tuple(got.shape) == (tokens, n_kv)
    plain["stride_matches"] = got.stride(0) == mqa_logits_row_stride(n_kv)
    plain["ok"] = plain["ok"] and plain["shape_ok"]
    res["plain"] = plain

    got_c = kernel(*args, True, 0)
    clean = compare(got_c, ref, bound, inside, tol)
    clean["outside_all_neg_inf"] = bool((got_c[~inside] == NEG_INF).all())
    clean["inside_equals_plain"] = bool(torch.equal(got_c[inside], got[inside]))
    clean["ok"] = clean["ok"] and clean["outside_all_neg_inf"]
    res["clean"] = clean
    del got_c

    width = max(1, res["max_range"] + case["extra_width"])
    got_z = kernel(*args, False, width)
    ref_z = torch.where(
        torch.arange(width, device=device) < (ke - ks).long()[:, None],
        shifted(ref, ks, width),
        NEG_INF,
    )
    inside_z = torch.isfinite(ref_z)
    comp = compare(got_z, ref_z, shifted(bound, ks, width), inside_z, tol)
    comp["width"] = width
    comp["shape_ok"] = tuple(got_z.shape) == (tokens, width)
    comp["stride_matches"] = got_z.stride(0) == mqa_logits_row_stride(n_kv, width)
    comp["equals_plain_shifted"] = bool(
        torch.equal(got_z[inside_z], shifted(got, ks, width)[inside_z])
    )
    if case["seed"] % 8 == 0:  # the reference's own compressed path, on this device
        direct = reference_fp8_mqa_logits(*args, False, width)
        comp["reference_direct_equals_shifted"] = bool(torch.equal(direct, ref_z))
    comp["ok"] = comp["ok"] and comp["shape_ok"]
    comp["ok"] = comp["ok"] and comp.get("reference_direct_equals_shifted", True)
    res["compressed"] = comp
    return res


def compressed_clean(
    case: dict[str, Any], kernel: Callable[..., torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """0.1.0 asserts ``not clean_logits`` when compressed: a rejection is the expected result."""
    inp = make_inputs(case, device)
    ks, ke = inp["ks"], inp["ke"]
    width = max(1, int((ke - ks).max()))
    res: dict[str, Any] = dict(case, width=width)
    try:
        got = kernel(inp["q"], inp["kv"], inp["weights"], ks, ke, True, width)
    except Exception as exc:  # deep_gemm: RuntimeError from the host assert; ours: PlanError
        res.update(rejected=True, error=f"{type(exc).__name__}: {str(exc)[:200]}", ok=True)
        return res
    past = torch.arange(width, device=device) >= (ke - ks).long()[:, None]
    res.update(rejected=False, past_all_neg_inf=bool((got[past] == NEG_INF).all()))
    res["ok"] = res["past_all_neg_inf"]
    return res


# --------------------------------------------------------------------------- timing


def timing(kernel: Callable[..., torch.Tensor], device: torch.device) -> list[dict[str, Any]]:
    """Median kernel times (CUDA events after warm-up); informative only."""
    if device.type != "cuda":
        return []
    rows = []
    for tokens, kv_tokens, heads in ((4096, 16384, 64), (4096, 16384, 32), (512, 4096, 64)):
        case = dict(tokens=tokens, kv_tokens=kv_tokens, heads=heads, kind="causal", seed=7)
        inp = make_inputs(case, device)
        args = (inp["q"], inp["kv"], inp["weights"], inp["ks"], inp["ke"])
        for clean in (False, True):
            for _ in range(3):
                kernel(*args, clean, 0)
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                kernel(*args, clean, 0)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000.0)
            rows.append(
                dict(tokens=tokens, kv_tokens=inp["kv_tokens"], heads=heads, clean=clean)
                | dict(median_us=sorted(times)[len(times) // 2])
            )
    return rows


# --------------------------------------------------------------------------- driver


def summarize(results: dict[str, Any], tol: float) -> str:
    per = results["cases"]

    def worst(section: str, key: str) -> float:
        return max((r[section][key] for r in per), default=0.0)

    def count(section: str, key: str) -> str:
        vals = [r[section][key] for r in per if key in r[section]]
        return f"{sum(vals)}/{len(vals)}"

    def line(name: str, rows: list[bool], notes: str) -> str:
        return f"{name:<17} {len(rows):>6} {sum(rows):>6} {len(rows) - sum(rows):>6}  {notes}"

    lines = [f"{'check':<17} {'cases':>6} {'pass':>6} {'fail':>6}  notes", "-" * 96]
    for section in ("plain", "clean", "compressed"):
        notes = (
            f"max rel {worst(section, 'rel_err'):.1e}, err/bound {worst(section, 'err_over_bound'):.1e}"
            f" (tol {tol:.0e}); row-rel {worst(section, 'row_rel'):.1e}, "
            f"elem-rel {worst(section, 'elem_rel'):.1e}"
        )
        if section == "plain":
            notes += f"; stride matches {count(section, 'stride_matches')}"
        if section == "clean":
            notes += f"; -inf outside {count(section, 'outside_all_neg_inf')}"
            notes += f"; inside == plain {count(section, 'inside_equals_plain')}"
        if section == "compressed":
            notes += f"; stride {count(section, 'stride_matches')}"
            notes += f"; == plain shifted {count(section, 'equals_plain_shifted')}"
            notes += f"; ref direct == shifted {count(section, 'reference_direct_equals_shifted')}"
        lines.append(line(section, [r[section]["ok"] for r in per], notes))
    cc = results["compressed_clean"]
    rejected = sum(r["rejected"] for r in cc)
    lines.append(line("compressed+clean", [r["ok"] for r in cc], f"rejected {rejected}/{len(cc)}"))
    for t in results["timing"]:
        lines.append(
            f"{'timing':<17} tokens {t['tokens']} kv {t['kv_tokens']} H {t['heads']} "
            f"clean {t['clean']}: {t['median_us']:.1f} us"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for verify_mqa_logits.json")
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-3, help="for both error gates")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-kv", type=int, default=16384)
    p.add_argument("--smoke", action="store_true", help="CPU, small, reference on both sides")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dg = _native.load() if cuda and not args.smoke else None
    if dg is None and not args.smoke:
        print("verify_mqa_logits: needs CUDA and deep_gemm (or --smoke)", file=sys.stderr)
        return 2
    if args.smoke:
        device = torch.device("cpu")
        args.max_tokens, args.max_kv = min(args.max_tokens, 40), min(args.max_kv, 300)

        def kernel(*a: Any) -> torch.Tensor:
            return fp8_mqa_logits(*a, backend="reference")

        print("SMOKE: the reference stands in for the kernel (CPU)")
    else:
        device = torch.device("cuda")
        kernel = dg.fp8_mqa_logits
    try:
        dg_version = importlib.metadata.version("sgl-deep-gemm")
    except importlib.metadata.PackageNotFoundError:
        dg_version = None
    results: dict[str, Any] = {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "sgl_deep_gemm": dg_version,
            "smoke": args.smoke,
        },
        "args": vars(args),
        "errors": [],
    }
    t0 = time.time()

    def write() -> None:  # after every section, so a crash later keeps what ran
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "verify_mqa_logits.json"), "w") as fh:
                json.dump(results, fh, indent=1, default=str)

    def section(name: str, fn: Callable[[], list[dict]]) -> None:
        t = time.time()
        try:
            results[name] = fn()
        except Exception:
            results[name] = []
            results["errors"].append({"section": name, "traceback": traceback.format_exc()})
        print(f"[{name}] {len(results[name])} results in {time.time() - t:.1f} s", flush=True)
        write()

    todo = cases(args.cases, args.seed, args.max_tokens, args.max_kv)

    def all_cases() -> list[dict]:
        out = []
        for i, c in enumerate(todo):
            try:
                out.append(run_case(c, kernel, device, args.tol))
            except Exception:  # one broken case must not hide the others' results
                results["errors"].append(
                    {"section": f"case {c}", "traceback": traceback.format_exc()}
                )
            if (i + 1) % 25 == 0:
                print(f"  {i + 1}/{len(todo)} cases", flush=True)
        return out

    section("cases", all_cases)
    section("compressed_clean", lambda: [compressed_clean(c, kernel, device) for c in todo[:4]])
    section("timing", lambda: [] if args.smoke else timing(kernel, device))
    results["wall_s"] = time.time() - t0

    failures = [
        {"check": s, **{k: v for k, v in r.items() if k not in ("plain", "clean", "compressed")}}
        | {"result": r[s]}
        for r in results["cases"]
        for s in ("plain", "clean", "compressed")
        if not r[s]["ok"]
    ] + [{"check": "compressed_clean", **r} for r in results["compressed_clean"] if not r["ok"]]
    results["failures"] = failures[:50]
    results["ok"] = not failures and not results["errors"] and bool(results["cases"])
    print(summarize(results, args.tol))
    for f in failures[:10]:
        print("FAIL", json.dumps(f, default=str)[:600])
    for e in results["errors"]:
        print(f"ERROR in {e['section']}:\n{e['traceback']}")
    print(f"overall: {'OK' if results['ok'] else 'FAILED'} in {results['wall_s']:.1f} s")
    write()
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
