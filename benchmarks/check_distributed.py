"""Judge the two-GPU runs of ``scripts/gpu_distributed.sh`` and write ``distributed.json``.

Each run's ``--json`` (written by rank 0 after gathering every rank's summary) and its
exit status are read back; the checks are the issue's "done when": the TP run finished
(no hang: a stalled collective fails after the group timeout) with plan digests agreed
for at least every one of ``--steps`` loop steps and equal tokens on both ranks; the DP
run finished with every replay verified against eager (debug), the same replay sizes
and FFN exchanges on both ranks, and both ranks idle for stretches. Exit status 0 only
when every check of every run asked for holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _read(out: Path, name: str) -> tuple[int | None, dict[str, Any] | None]:
    rc_file, data_file = out / f".rc_{name}", out / f"dist_{name}.json"
    rc = int(rc_file.read_text()) if rc_file.is_file() else None
    data = json.loads(data_file.read_text()) if data_file.is_file() else None
    return rc, data


def check_tp(rc: int | None, data: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    total = (data or {}).get("aggregate", {})
    checks = {
        "finished (rc 0, no hang)": rc == 0,
        "digests agreed for every forward": bool(total.get("digests_every_forward")),
        f"at least {steps} digest checks per rank": min(total.get("digest_checks", [0])) >= steps,
        "tokens equal across ranks": bool(total.get("tokens_equal_across_ranks")),
        "graphs replayed": min(total.get("graph_replays", [0])) > 0,
    }
    return {"rc": rc, "checks": checks, "ok": all(checks.values()), "aggregate": total}


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
    return {"rc": rc, "checks": checks, "ok": all(checks.values()), "aggregate": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", choices=("tp", "dp"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    judge = {"tp": check_tp, "dp": check_dp}
    report = {name: judge[name](*_read(args.out, name), args.steps) for name in args.runs}
    (args.out / "distributed.json").write_text(json.dumps(report, indent=2))
    for name, result in report.items():
        print(name, "OK" if result["ok"] else "FAILED", json.dumps(result["checks"]))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
