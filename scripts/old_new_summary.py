#!/usr/bin/env python3
"""Old and new tree side by side: the figures of a ``scripts/gpu_old_new.sh`` call.

Reads the call's result folder (``$OUT/old_new`` on the device, before it is packed) or the
packed ``old_new.tar.gz`` brought back, whose files are named ``STEP_TREE_N.json`` (TREE
``old`` or ``new``, N the run's number in that tree), and prints one table per step:

- decode runs (``small``, ``mixed``, ``shapes``, ``arrivals``, ``eager``): the ``decode``
  summary's planner host time per replay, per ragged replay, per eager and extend plan,
  tokens/s, step p50 / p99, the replay and fallback counts;
- ``refresh`` (``python -m benchmarks replay_overhead``): the runner's refresh, median (p99) us,
  per batch size and staging;
- ``po`` (``python -m benchmarks planner_overhead``): eager ``plan()`` over the hand-written code
  (median of per-call ratios), the same for a growing decode, and the host times;

each run in its own column (old runs, then new), then new / old of the runs' medians; and
issue 53's targets checked on the new tree's runs. Standard library only, so it runs on the
device before packing and here on what came back:

    python3 scripts/old_new_summary.py "$OUT/old_new" > "$OUT/summary.txt"
    python3 scripts/old_new_summary.py /path/to/old_new.tar.gz
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

NAME = re.compile(
    r"^(?:.*/)?(?P<step>[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*?)_(?P<tree>old|new)_(?P<n>\d+)\.(?P<ext>json|txt)$"
)

DECODE_ROWS = (
    ("replay us", "planner_us_per_replay"),
    ("ragged replay us", "planner_us_per_ragged_replay"),
    ("eager plan us", "planner_us_per_eager_plan"),
    ("extend plan us", "planner_us_per_extend_plan"),
    ("tokens/s", "tokens_per_second"),
    ("decode tokens/s", "decode_tokens_per_second"),
    ("step p50 ms", "step_ms_p50"),
    ("step p99 ms", "step_ms_p99"),
    ("ttft p50 ms", "ttft_ms_p50"),
    ("graph replays", "graph_replays"),
    ("ragged replays", "ragged_replays"),
    ("eager fallbacks", "eager_fallbacks"),
    ("wall s", "wall_seconds"),
)
"""(label, key of the decode summary)."""

TARGETS = {"replay": 25.0, "ragged": 40.0, "refresh": 15.0, "plan_ratio": 0.8}
"""Issue 53's "Done when": us per decode/verify replay, per extend/mixed replay, runner
refresh median, and eager decode ``plan()`` over the hand-written code."""


def load(source: Path) -> tuple[dict[tuple[str, str, int], Any], dict[str, str]]:
    """``{(step, tree, n): parsed JSON}`` and ``{run name: last log line}`` of runs that
    left no JSON (failed, timed out, or skipped), from a folder or a ``.tar.gz``."""
    texts: dict[str, bytes] = {}
    if source.is_dir():
        for path in source.rglob("*"):
            if path.is_file():
                texts[path.name] = path.read_bytes()
    else:
        with tarfile.open(source) as tar:
            for member in tar.getmembers():
                fh = tar.extractfile(member) if member.isfile() else None
                if fh is not None:
                    texts[Path(member.name).name] = fh.read()
    runs: dict[tuple[str, str, int], Any] = {}
    missing: dict[str, str] = {}
    for name, data in sorted(texts.items()):
        m = NAME.match(name)
        if not m:
            continue
        key = (m["step"], m["tree"], int(m["n"]))
        stem = name.rsplit(".", 1)[0]
        if m["ext"] == "json":
            try:
                runs[key] = json.loads(data)
            except ValueError as exc:
                missing[stem] = f"unreadable JSON: {exc}"
        elif f"{stem}.json" not in texts:
            lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
            missing[stem] = lines[-1].strip()[:160] if lines else "(no output)"
    return runs, missing


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):  # counts by size or kind: their total
        nums = [_num(v) for v in value.values()]
        return sum(n for n in nums if n is not None)
    return None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def _median(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return statistics.median(nums) if nums else None


def _ratio(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "-"
    return f"{new / old:.3f}"


def table(title: str, head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    out = [title]
    out.append(
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))
    )
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
    return "\n".join(out)


def by_tree(runs: dict, step: str) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The step's runs as ``[(column label, json)]``, old then new, in run order."""
    pick = lambda tree: [  # noqa: E731
        (f"{tree}{n}", data) for (s, t, n), data in sorted(runs.items()) if s == step and t == tree
    ]
    return pick("old"), pick("new")


def decode_table(step: str, old: list, new: list) -> tuple[str, dict[str, float | None]]:
    head = ["figure", *(c for c, _ in old), *(c for c, _ in new), "new/old"]
    rows, medians = [], {}
    for label, key in DECODE_ROWS:
        o = [_num(d.get("summary", d).get(key)) for _, d in old]
        n = [_num(d.get("summary", d).get(key)) for _, d in new]
        if all(v is None for v in o + n):
            continue
        mo, mn = _median(o), _median(n)
        medians[f"old {key}"], medians[f"new {key}"] = mo, mn
        rows.append([label, *map(_fmt, o), *map(_fmt, n), _ratio(mn, mo)])
    first = (new or old)[0][1].get("summary", {})
    extra = ", ".join(
        f"{k} {first.get(k)}"
        for k in ("layers", "staging", "graph_kind", "steps_by_mode", "requests_finished")
        if k in first
    )
    return table(f"decode: {step}" + (f"  ({extra})" if extra else ""), head, rows), medians


def refresh_table(old: list, new: list) -> tuple[str, dict]:
    """The runner's refresh per (bs, staging): p50 (p99) us per run."""
    keys: list[tuple[int, str]] = []
    for _, d in old + new:
        for r in d.get("rows", []):
            k = (r["bs"], r.get("staging", "copy"))
            if k not in keys:
                keys.append(k)
    head = ["refresh: bs staging", *(c for c, _ in old), *(c for c, _ in new), "new/old p50"]
    rows, worst_new = [], {}

    def cell(d: Any, k: tuple[int, str]) -> tuple[str, float | None]:
        for r in d.get("rows", []):
            if (r["bs"], r.get("staging", "copy")) == k:
                ref = r.get("refresh", {})
                return f"{_fmt(ref.get('p50'))} ({_fmt(ref.get('p99'))})", ref.get("p50")
        return "-", None

    for k in keys:
        o = [cell(d, k) for _, d in old]
        n = [cell(d, k) for _, d in new]
        mo, mn = _median([v for _, v in o]), _median([v for _, v in n])
        worst_new[k] = mn
        rows.append([f"{k[0]} {k[1]}", *(c for c, _ in o), *(c for c, _ in n), _ratio(mn, mo)])
    title = "refresh: GraphRunner.step's planner refresh, median (p99) us"
    dev = next((d.get("device") for _, d in old + new if d.get("device")), None)
    return table(title + (f"  ({dev})" if dev else ""), head, rows), worst_new


def po_table(old: list, new: list) -> tuple[str, dict]:
    """Eager plan over hand-written (median of per-call ratios) and the host times, per bs."""
    cols = (
        ("plan/hand", lambda r: 1 / r["eager"]["hand_plan"]["ratio_to_first"]),
        ("growing plan/hand", lambda r: 1 / r["growing"]["hand_plan"]["ratio_to_first"]),
        ("plan us", lambda r: r["eager"]["plan"]["median_us"]),
        ("hand plan us", lambda r: r["eager"]["hand_plan"]["median_us"]),
        ("replay pulled us", lambda r: r["replay"]["replay_pulled"]["median_us"]),
        ("replay copy us", lambda r: r["replay"]["replay_copy"]["median_us"]),
        ("hand replay us", lambda r: r["replay"]["hand_replay"]["median_us"]),
        ("verify replay us", lambda r: r["verify_replay"]["median_us"]),
    )
    batches: list[int] = []
    for _, d in old + new:
        for r in d.get("results", []):
            if r["batch"] not in batches:
                batches.append(r["batch"])
    head = ["po: bs / figure", *(c for c, _ in old), *(c for c, _ in new), "new/old"]
    rows: list[list[str]] = []
    new_medians: dict[str, dict[int, float | None]] = {label: {} for label, _ in cols}

    def get(d: Any, bs: int, fn) -> float | None:
        for r in d.get("results", []):
            if r["batch"] == bs:
                try:
                    return float(fn(r))
                except (KeyError, TypeError, ZeroDivisionError):
                    return None
        return None

    for bs in batches:
        for label, fn in cols:
            o = [get(d, bs, fn) for _, d in old]
            n = [get(d, bs, fn) for _, d in new]
            if all(v is None for v in o + n):
                continue
            mo, mn = _median(o), _median(n)
            new_medians[label][bs] = mn
            ratio = "" if "/" in label else _ratio(mn, mo)
            rows.append([f"{bs} {label}", *map(_fmt, o), *map(_fmt, n), ratio])
    ext_o = [_num(d.get("extend", {}).get("median_us")) for _, d in old]
    ext_n = [_num(d.get("extend", {}).get("median_us")) for _, d in new]
    if any(v is not None for v in ext_o + ext_n):
        rows.append(
            [
                "extend plan 2048 us",
                *map(_fmt, ext_o),
                *map(_fmt, ext_n),
                _ratio(_median(ext_n), _median(ext_o)),
            ]
        )
    title = "po: eager plan() vs hand-written (ratios: median of per-call ratios), host us"
    return table(title, head, rows), new_medians


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "MISSED")


def render(runs: dict, missing: dict[str, str]) -> str:
    steps = list(dict.fromkeys(s for s, _, _ in sorted(runs, key=lambda k: k[0])))
    order = ["small", "mixed", "arrivals", "shapes", "eager", "refresh", "po"]
    steps.sort(key=lambda s: (order.index(s) if s in order else len(order), s))
    parts, checks = [], []
    for step in steps:
        old, new = by_tree(runs, step)
        sample = (new or old)[0][1]
        if "summary" in sample:
            text, med = decode_table(step, old, new)
            rep, rag = (
                med.get("new planner_us_per_replay"),
                med.get("new planner_us_per_ragged_replay"),
            )
            tn, to = med.get("new tokens_per_second"), med.get("old tokens_per_second")
            checks.append(
                f"{step}: replay {_fmt(rep)} us <= {TARGETS['replay']:.0f}: "
                f"{_mark(None if not rep else rep <= TARGETS['replay'])}; "
                f"ragged {_fmt(rag)} us <= {TARGETS['ragged']:.0f}: "
                f"{_mark(None if not rag else rag <= TARGETS['ragged'])}; "
                f"tokens/s new {_fmt(tn)} >= old {_fmt(to)}: "
                f"{_mark(None if tn is None or to is None else tn >= to)}"
            )
        elif "rows" in sample:
            text, worst = refresh_table(old, new)
            vals = [v for v in worst.values() if v is not None]
            top = max(vals) if vals else None
            checks.append(
                f"refresh: worst median {_fmt(top)} us <= {TARGETS['refresh']:.0f}: "
                f"{_mark(None if top is None else top <= TARGETS['refresh'])}"
            )
        elif "results" in sample:
            text, medians = po_table(old, new)
            for label, target in (
                ("plan/hand", TARGETS["plan_ratio"]),
                ("replay pulled us", TARGETS["replay"]),
                ("verify replay us", TARGETS["replay"]),
            ):
                vals = [v for v in medians[label].values() if v is not None]
                top = max(vals) if vals else None
                checks.append(
                    f"po: worst {label} over bs {_fmt(top)} <= {target}: "
                    f"{_mark(None if top is None else top <= target)}"
                )
        else:
            text = f"{step}: unknown JSON (keys {sorted(sample)[:8]})"
        parts.append(text)
    if checks:
        parts.append("issue 53 targets, new tree (median of its runs):\n  " + "\n  ".join(checks))
    if missing:
        parts.append(
            "runs without JSON (failed, timed out or skipped):\n  "
            + "\n  ".join(f"{k}: {v}" for k, v in sorted(missing.items()))
        )
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="the result folder, or old_new.tar.gz")
    args = p.parse_args(argv)
    if not args.source.exists():
        print(f"{args.source}: not found", file=sys.stderr)
        return 1
    runs, missing = load(args.source)
    if not runs and not missing:
        print(f"{args.source}: no STEP_old_N / STEP_new_N results", file=sys.stderr)
        return 1
    sys.stdout.write(render(runs, missing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
