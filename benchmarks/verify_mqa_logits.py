#!/usr/bin/env python3
"""Compare backends.deepgemm's ragged ``fp8_mqa_logits`` reference with the real kernel.

Run on the CUDA machine with sgl-deep-gemm 0.1.0 (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 benchmarks/verify_mqa_logits.py --out "$OUT"

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
reference standing in for the kernel (tests/test_mqa_logits.py runs that).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.deepgemm import _native, fp8_mqa_logits  # noqa: E402
from benchmarks.mqa_logits_cases import cases, make_inputs  # noqa: E402
from benchmarks.mqa_logits_checks import compressed_clean, run_case  # noqa: E402

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
