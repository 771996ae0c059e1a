"""Judge the two-GPU runs of ``scripts/gpu_distributed.sh`` and write ``distributed.json``.

Each run's ``--json`` (written by rank 0 after gathering every rank's summary, or by the one
process of a ``ref_*`` run) and its exit status are read back; the checks are the issues'
"done when":

- ``tp`` (issue 18): the run finished (no hang: a stalled collective fails after the group
  timeout) with plan digests agreed for at least every one of ``--steps`` loop steps and
  equal tokens on both ranks;
- ``dp`` (issue 18): finished with every replay verified against eager (debug), the same
  replay sizes and FFN exchanges on both ranks, and both ranks idle for stretches;
- ``tp_mtp`` / ``tp_ngram`` (issue 40): finished, every one of ``--requests`` requests
  finished, tokens equal on both ranks, a plan digest agreed after every forward (digest
  checks == signature checks on every rank), the draft's forwards among them (MTP:
  ``target_verify``, ``draft_extend`` and ``draft_decode``), the same checks by mode on
  every rank;
- ``dp_mtp`` / ``dp_ngram`` (issue 40): finished, every request finished, every replay
  verified, the same sizes and exchanges on both ranks, IDLE batches replayed in the verify
  and draft shapes (a rank idle in a verify slot idles in the draft's too), no decode graph
  replayed (speculation has no decode forward), both ranks idle for stretches;
- ``ref_mtp`` / ``ref_ngram``: the one-GPU (TP = 1) run of the same workload finished.

With ``tp_DRAFT`` and ``ref_DRAFT`` both found, the ``tp_DRAFT`` entry gets ``vs_tp1``: how
many requests' tokens are equal under TP = 2 and TP = 1. In bf16 on GPUs they need not be
(TP = 2 sums ``wo``'s two partials in an all-reduce, another summation order than one GPU's
matmul), so it is reported, not checked, unless ``--require-tp1-equal`` (the CPU: float64
partials, the same bits). Every entry has ``tokens_per_second`` (in all, and per rank).

Runs are looked up in ``--out`` and then in each ``--also`` folder (files brought back by
earlier device calls), so runs made in different calls are compared here afterwards.
Exit status 0 only when every check of every run asked for holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RUNS = ("tp", "dp", "tp_mtp", "tp_ngram", "dp_mtp", "dp_ngram", "ref_mtp", "ref_ngram")
# the forward modes a draft adds, each checked (TP) or idled in (DP)
DRAFT_MODES = {
    "mtp": ("target_verify", "draft_extend", "draft_decode"),
    "ngram": ("target_verify",),
}
TP1_NOTE = (
    "reported, not required: in bf16 TP = 2 all-reduces wo's partial sums, another summation "
    "order than one GPU, so greedy tokens may part"
)


def _read(dirs: list[Path], name: str) -> tuple[int | None, dict[str, Any] | None, str | None]:
    """A run's exit status and ``--json``, from the first folder that has either."""
    for folder in dirs:
        rc_file, data_file = folder / f".rc_{name}", folder / f"dist_{name}.json"
        if rc_file.is_file() or data_file.is_file():
            rc = int(rc_file.read_text()) if rc_file.is_file() else None
            data = json.loads(data_file.read_text()) if data_file.is_file() else None
            return rc, data, str(folder)
    return None, None, None


def _rates(data: dict[str, Any] | None) -> dict[str, Any]:
    data = data or {}
    if "summary" in data:  # one process
        rate = data["summary"].get("tokens_per_second")
        return {"aggregate": rate, "per_rank": [rate]}
    return {
        "aggregate": data.get("aggregate", {}).get("tokens_per_second"),
        "per_rank": [r.get("tokens_per_second") for r in data.get("ranks", [])],
    }


def _result(rc: int | None, data: dict[str, Any] | None, checks: dict[str, bool]) -> dict[str, Any]:
    return {
        "rc": rc,
        "checks": checks,
        "ok": all(checks.values()),
        "tokens_per_second": _rates(data),
        "aggregate": (data or {}).get("aggregate", (data or {}).get("summary", {})),
    }


def _drop_unasked(checks: dict[str, bool], requests: int | None) -> dict[str, bool]:
    """Without ``--requests`` there is no count to hold the finished requests to."""
    return {k: v for k, v in checks.items() if requests is not None or "requests finished" not in k}


def check_tp(rc: int | None, data: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    total = (data or {}).get("aggregate", {})
    checks = {
        "finished (rc 0, no hang)": rc == 0,
        "digests agreed for every forward": bool(total.get("digests_every_forward")),
        f"at least {steps} digest checks per rank": min(total.get("digest_checks", [0])) >= steps,
        "tokens equal across ranks": bool(total.get("tokens_equal_across_ranks")),
        "graphs replayed": min(total.get("graph_replays", [0])) > 0,
    }
    return _result(rc, data, checks)


def check_dp(rc: int | None, data: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    total = (data or {}).get("aggregate", {})
    equal = total.get("equal_across_ranks", {})
    idle = total.get("idle_forwards", [0, 0])
    checks = {
        "finished (rc 0, no hang)": rc == 0,
        "every replay verified against eager": bool(total.get("every_replay_verified")),
        "same sizes and exchanges on every rank": bool(equal) and all(equal.values()),
        "every rank idle for stretches": min(idle) >= steps // 20,
        "graphs replayed": min(total.get("graph_replays", [0])) > 0,
    }
    return _result(rc, data, checks)


def check_tp_spec(
    rc: int | None, data: dict[str, Any] | None, draft: str, requests: int | None
) -> dict[str, Any]:
    total = (data or {}).get("aggregate", {})
    ranks = (data or {}).get("ranks", [])
    signatures, digests = total.get("signature_checks", []), total.get("digest_checks", [])
    by_mode = total.get("checks_by_mode", {})
    modes = DRAFT_MODES[draft]
    checks = {
        "finished (rc 0, no hang)": rc == 0,
        f"all {requests} requests finished": total.get("requests_finished") == requests,
        "tokens equal across ranks": bool(total.get("tokens_equal_across_ranks")),
        "digests agreed for every forward": bool(total.get("digests_every_forward")),
        "digest checks == signature checks on every rank": bool(signatures)
        and len(digests) == len(signatures) == total.get("world")
        and all(d == s > 0 for d, s in zip(digests, signatures, strict=True)),
        f"{', '.join(modes)} forwards checked": all(by_mode.get(m, 0) > 0 for m in modes),
        "checks by mode add up to the signature checks": bool(signatures)
        and sum(by_mode.values()) == signatures[0],
        "same checks by mode on every rank": bool(ranks)
        and all(r.get("checks_by_mode") == by_mode for r in ranks),
        "graphs replayed": min(total.get("graph_replays", [0])) > 0,
        "ranks agree": bool(total.get("agree")),
    }
    return _result(rc, data, _drop_unasked(checks, requests))


def check_dp_spec(
    rc: int | None, data: dict[str, Any] | None, draft: str, requests: int | None, steps: int
) -> dict[str, Any]:
    total = (data or {}).get("aggregate", {})
    ranks = (data or {}).get("ranks", [])
    equal = total.get("equal_across_ranks", {})
    shapes = total.get("idle_by_shape", [])
    idled = {shape for rank in shapes for shape, n in rank.items() if n > 0}
    modes = DRAFT_MODES[draft]
    verified = total.get("verified_replays", [])
    checks = {
        "finished (rc 0, no hang)": rc == 0,
        f"all {requests} requests finished": total.get("requests_finished") == requests,
        "every replay verified against eager": total.get("every_replay_verified") is True
        and bool(verified)
        and min(verified) > 0,
        "same sizes and exchanges on every rank": bool(equal) and all(equal.values()),
        f"IDLE batches replayed as {', '.join(modes)}": set(modes) <= idled,
        "a rank idle in a verify slot idles in the draft's too": all(
            all(rank.get(m, 0) > 0 for m in modes) for rank in shapes if rank.get("target_verify")
        ),
        "no decode graph replayed": bool(ranks)
        and not any(k.startswith("decode:") for r in ranks for k in r.get("replays_by_size", {})),
        f"every rank idle for at least {steps // 20} forwards": bool(total.get("idle_forwards"))
        and min(total["idle_forwards"]) >= steps // 20,
        "graphs replayed": min(total.get("graph_replays", [0])) > 0,
        "ranks agree": bool(total.get("agree")),
    }
    return _result(rc, data, _drop_unasked(checks, requests))


def check_ref(rc: int | None, data: dict[str, Any] | None, requests: int | None) -> dict[str, Any]:
    summary = (data or {}).get("summary", {})
    checks = {
        "finished (rc 0)": rc == 0,
        f"all {requests} requests finished": summary.get("requests_finished") == requests,
    }
    return _result(rc, data, _drop_unasked(checks, requests))


def compare_tokens(tp: dict[str, list[int]], ref: dict[str, list[int]]) -> dict[str, Any]:
    """How many requests' tokens are equal under TP = 2 and TP = 1 (finished requests)."""
    both = sorted(set(tp) & set(ref), key=int)
    differ = [rid for rid in both if tp[rid] != ref[rid]]
    first = {}
    for rid in differ[:10]:
        a, b = tp[rid], ref[rid]
        first[rid] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {
        "requests_tp2": len(tp),
        "requests_tp1": len(ref),
        "compared": len(both),
        "equal": len(both) - len(differ),
        "all_equal": not differ and set(tp) == set(ref),
        "differing": differ[:50],
        "first_differing_token": first,
        "only_tp2": sorted(set(tp) - set(ref), key=int)[:50],
        "only_tp1": sorted(set(ref) - set(tp), key=int)[:50],
    }


def judge(
    names: list[str],
    dirs: list[Path],
    steps: int = 1000,
    requests: int | None = None,
    spec_steps: int = 600,
    require_tp1_equal: bool = False,
) -> dict[str, Any]:
    """Every run's entry of ``distributed.json``."""
    report: dict[str, Any] = {}
    for name in names:
        rc, data, folder = _read(dirs, name)
        kind, _, draft = name.partition("_")
        if name == "tp":
            result = check_tp(rc, data, steps)
        elif name == "dp":
            result = check_dp(rc, data, steps)
        elif kind == "tp":
            result = check_tp_spec(rc, data, draft, requests)
            _, ref, ref_folder = _read(dirs, f"ref_{draft}")
            if data is not None and ref is not None:
                vs = compare_tokens(data.get("tokens", {}), ref.get("tokens", {}))
                vs.update(reference=str(Path(ref_folder or ".") / f"dist_ref_{draft}.json"))
                vs["note"] = "required (--require-tp1-equal)" if require_tp1_equal else TP1_NOTE
                result["vs_tp1"] = vs
                if require_tp1_equal:
                    result["checks"]["tokens equal to the TP = 1 run"] = vs["all_equal"]
                    result["ok"] = all(result["checks"].values())
        elif kind == "dp":
            result = check_dp_spec(rc, data, draft, requests, spec_steps)
        else:
            result = check_ref(rc, data, requests)
        result["from"] = folder
        report[name] = result
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", choices=RUNS)
    parser.add_argument(
        "--out", type=Path, required=True, help="runs here; distributed.json written here"
    )
    parser.add_argument(
        "--also", type=Path, action="append", default=[], help="more folders of runs"
    )
    parser.add_argument("--steps", type=int, default=1000, help="tp, dp: their loop steps")
    parser.add_argument("--requests", type=int, help="speculative runs: requests that must finish")
    parser.add_argument("--spec-steps", type=int, default=600, help="dp_*: their loop-step cap")
    parser.add_argument("--require-tp1-equal", action="store_true")
    args = parser.parse_args(argv)
    report = judge(
        args.runs,
        [args.out, *args.also],
        steps=args.steps,
        requests=args.requests,
        spec_steps=args.spec_steps,
        require_tp1_equal=args.require_tp1_equal,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed.json").write_text(json.dumps(report, indent=2))
    for name, result in report.items():
        print(name, "OK" if result["ok"] else "FAILED", json.dumps(result["checks"]))
        if "vs_tp1" in result:
            vs = result["vs_tp1"]
            print(f"  {name} vs TP = 1: {vs['equal']} of {vs['compared']} requests' tokens equal")
        print(f"  {name} tokens/s: {json.dumps(result['tokens_per_second'])}")
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
