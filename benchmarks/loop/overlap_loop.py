#!/usr/bin/env python3
"""The overlapped decode loop against the plain one: throughput, step times, GPU busy, tokens.

For each case the decode CLI runs in fresh processes, ``--overlap`` and ``--no-overlap``
alternating (the variant that goes first swaps each round, so the host's drift falls on both
alike) for ``--repeats`` rounds, then one round profiled (``--gpu-busy``). Per case and
variant the table gives the medians over the unprofiled rounds of tokens/s, step ms p50/p99,
loop step ms p50 and TTFT ms p50, and the profiled round's GPU busy fraction (the device time
of a window of loop steps over the unprofiled pace of the steps next to it; the profiler's
start and stop fall inside that run's loop, so its other figures are not used),
the overlap's speed-up in tokens/s, and whether every request generated the same tokens in
every run: overlapping the host with the device must not change what is decoded, so tokens
that differ make the exit status 1, as does a run that fails (after reporting the rest).

    python3 -m benchmarks overlap_loop --out $OUT/overlap_loop.json --plot $OUT/overlap_loop.png

A CPU smoke run of the plumbing (no GPU busy there):

    python3 -m benchmarks overlap_loop --case 'tiny=dsv32-tiny:--requests 4' --gpu-busy 0 \\
        --repeats 1 --extra='--device cpu'
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, plot_bars, print_table, write_json

GPU_STEPS = {
    "": "--out {out}/overlap_loop.json --plot {out}/overlap_loop.png",
    "*": "--cases {variant} --out {out}/overlap_loop_{tag}.json",
}

CASES: dict[str, tuple[str, list[str]]] = {
    "small16": ("dsv32-small", ["--requests", "16"]),
    "small64": ("dsv32-small", ["--requests", "64"]),
    "arrivals": ("dsv32-small-arrivals", []),  # the defaults: mixed under ragged graphs
    "shapes": ("dsv32-shapes", ["--requests", "64"]),
}
"""Default cases: name -> (config, the case's own arguments)."""
VARIANTS = ("overlap", "no-overlap")
METRICS = {
    "tokens_per_second": "tok/s",
    "step_ms_p50": "step p50",
    "step_ms_p99": "step p99",
    "loop_step_ms_p50": "loop p50",
    "ttft_ms_p50": "ttft p50",
    "gpu_busy": "busy",
}
"""What :func:`read_run` keeps of a run's summary and :func:`variant_summary` takes medians
of, with their columns' labels."""

Runner = Callable[[list[str], float], subprocess.CompletedProcess]


def parse_case(text: str) -> tuple[str, tuple[str, list[str]]]:
    """``NAME=CONFIG[:ARGS]`` -> (name, (config, args)); ARGS split like a shell would."""
    name, sep, rest = text.partition("=")
    config, _, extra = rest.partition(":")
    if not sep or not name or not config:
        raise argparse.ArgumentTypeError(f"expected NAME=CONFIG[:ARGS], got {text!r}")
    return name, (config, shlex.split(extra))


def command(
    config: str,
    case_args: Sequence[str],
    variant: str | None,
    json_path: Path,
    gpu_busy: int,
    extra: Sequence[str],
) -> list[str]:
    """The decode CLI's command line for one run (``extra`` last, so it overrides): with
    ``--VARIANT`` unless ``variant`` is None (the loop's own choice). The CLI is ``python -m
    planner`` (``python -m dsv32_engine.serving.cli`` only defines ``main``: it would exit 0
    having run nothing)."""
    cmd = [sys.executable, "-m", "planner", "decode", "--config", config]
    cmd += ["--quiet", "--json", str(json_path)]
    if variant is not None:
        cmd.append(f"--{variant}")
    if gpu_busy:
        cmd += ["--gpu-busy", str(gpu_busy)]
    return cmd + list(case_args) + list(extra)


def read_run(payload: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of one run's ``--json`` file: the summary's metrics (the
    busy fraction as ``gpu_busy``, its window as ``gpu_busy_window``), whether the loop
    overlapped and why not, and the tokens by request id (as strings, the JSON's keys);
    ``tokens`` is None where the file holds none."""
    summary = payload["summary"]
    window = summary.get("gpu_busy")
    tokens = payload.get("tokens")
    return {
        **{key: summary.get(key) for key in METRICS if key != "gpu_busy"},
        "gpu_busy": window.get("fraction") if window else None,
        "gpu_busy_window": window,
        "overlap": summary.get("overlap"),
        "overlap_reason": summary.get("overlap_reason"),
        "interrupted": summary.get("interrupted"),
        "generated_tokens": summary.get("generated_tokens"),
        "tokens": None if tokens is None else {str(k): list(v) for k, v in tokens.items()},
    }


def median_of(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the runs that measure it: the busy fraction over the
    profiled runs, everything else over the unprofiled ones (a profiler's start, stop and
    parsing land inside a profiled run's loop and would skew its times)."""
    profiled = key == "gpu_busy"
    values = [
        run[key]
        for run in runs
        if run.get(key) is not None and bool(run.get("profiled")) == profiled
    ]
    return statistics.median(values) if values else None


def variant_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a variant's runs of :data:`METRICS`, and whether its runs overlapped:
    ``overlap`` True or False where they agree (None where they do not, or say nothing)
    with each distinct reason the loop gave."""
    states = {run.get("overlap") for run in runs}
    reasons = sorted({run["overlap_reason"] for run in runs if run.get("overlap_reason")})
    return {
        "runs": len(runs),
        **{key: median_of(runs, key) for key in METRICS},
        "overlap": states.pop() if len(states) == 1 else None,
        "overlap_reasons": reasons,
    }


def differing_requests(reference: dict[str, list[int]], other: dict[str, list[int]]) -> list[str]:
    """Request ids whose tokens differ between two runs (one run lacking a request counts)."""
    return _ids(
        rid for rid in reference.keys() | other.keys() if reference.get(rid) != other.get(rid)
    )


def _ids(ids) -> list[str]:
    """Request ids (strings of integers, the JSON's keys) in numeric order."""
    return sorted(ids, key=lambda rid: (len(rid), rid))


def compare_case(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One case's variants side by side: each variant's summary, the speed-up (overlap over
    no-overlap tokens/s) and whether tokens are equal: every run's, of either variant,
    against the first no-overlap run's (None where no run kept tokens)."""
    out: dict[str, Any] = {v: variant_summary(runs.get(v, [])) for v in VARIANTS}
    fast, base = out["overlap"]["tokens_per_second"], out["no-overlap"]["tokens_per_second"]
    out["speedup"] = fast / base if fast is not None and base else None
    kept = [run for v in ("no-overlap", "overlap") for run in runs.get(v, [])]
    kept = [run for run in kept if run.get("tokens") is not None]
    differ: set[str] = set()
    for run in kept[1:]:
        differ.update(differing_requests(kept[0]["tokens"], run["tokens"]))
    out["tokens_equal"] = not differ if len(kept) >= 2 else None
    out["differing_requests"] = _ids(differ)
    return out


def table_rows(results: dict[str, dict[str, Any]]) -> list[tuple]:
    """One row per case and variant; the speed-up and token check on the overlap row."""
    rows = []
    for case, result in results.items():
        equal = result["tokens_equal"]
        check = {True: "yes", None: "n/a"}.get(equal, f"NO ({len(result['differing_requests'])})")
        for variant in VARIANTS:
            s = result[variant]
            if not s["runs"]:
                continue
            state = {True: "on", False: "off", None: "?"}[s["overlap"]]
            if s["overlap_reasons"]:
                state += f" ({'; '.join(s['overlap_reasons'])})"
            first = variant == "overlap"
            speedup = _cell(result["speedup"]) if first else ""
            metrics = (_cell(s[key]) for key in METRICS)
            rows.append((case, variant, *metrics, speedup, check if first else "", state))
    return rows


def _cell(value: float | None) -> float | str:
    return "-" if value is None else float(value)


def run_process(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The default :data:`Runner`: ``cmd`` from the repository root, output captured; past
    ``timeout`` seconds it is stopped and reads as exit 124 (``timeout``'s own status)."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        return subprocess.CompletedProcess(cmd, 124, "", f"{err or ''}\ntimed out after {timeout}s")


def run_decode(
    cmd: list[str], json_path: Path, runner: Runner, timeout: float, tail: int, where: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One decode CLI run: ``(its --json file's payload, None)``, or ``(None, failure)`` where
    it failed or wrote no file (the failure printed, with the last ``tail`` lines of its
    stderr, and returned as the exit status, command line and that tail)."""
    done = runner(cmd, timeout)
    if done.returncode == 0 and json_path.exists():
        return json.loads(json_path.read_text()), None
    text = "\n".join((done.stderr or "").splitlines()[-tail:])
    text = text or "(no stderr; the run wrote no --json file)"
    print(
        f"{where} failed (exit {done.returncode}): {shlex.join(cmd)}\n{text}",
        file=sys.stderr,
        flush=True,
    )
    return None, {"exit": done.returncode, "command": shlex.join(cmd), "stderr_tail": text}


def run_case(name, config, case_args, args, extra, runner: Runner, progress) -> dict[str, Any]:
    """The case's runs, alternating the variants; stops at the first run that fails.
    ``progress`` is [runs started, runs planned] over all cases (a failure drops the case's
    remaining runs from the plan)."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    order = [
        (round_, variant)
        for round_ in range(rounds(args))
        for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1])
    ]
    with tempfile.TemporaryDirectory(prefix="overlap_loop-") as tmp:
        for k, (round_, variant) in enumerate(order):
            progress[0] += 1
            profiled = round_ >= args.repeats  # the last round, profiled (--gpu-busy)
            which = "profiled" if profiled else f"round {round_ + 1}/{args.repeats}"
            where = f"{name} {variant} ({which})"
            print(f"[{progress[0]}/{progress[1]}] {where}", file=sys.stderr, flush=True)
            path = Path(tmp) / f"{name}-{variant}-{round_}.json"
            busy = args.gpu_busy if profiled else 0
            cmd = command(config, case_args, variant, path, busy, extra)
            payload, failed = run_decode(cmd, path, runner, args.timeout, args.tail, where)
            if failed is not None:
                progress[1] -= len(order) - k - 1
                failure = {"variant": variant, "round": round_, **failed}
                return {"config": config, "args": list(case_args), "runs": runs, "failure": failure}
            runs[variant].append({**read_run(payload), "profiled": profiled})
    return {"config": config, "args": list(case_args), "runs": runs, "failure": None}


def rounds(args: argparse.Namespace) -> int:
    """Rounds of both variants per case: ``--repeats`` unprofiled, and one profiled for the
    busy fraction where ``--gpu-busy`` asks for it."""
    return args.repeats + (1 if args.gpu_busy else 0)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a benchmark that runs the decode CLI per case: cases defined on the
    command line, arguments added to every run, a run's time limit and the stderr shown
    of a failed one (``decode_runs`` takes them too)."""
    p.add_argument(
        "--case",
        type=parse_case,
        action="append",
        default=[],
        metavar="NAME=CONFIG[:ARGS]",
        help="define (or redefine) a case",
    )
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="ARGS",
        help="arguments added to every run, e.g. --extra='--device cpu'",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--tail", type=int, default=30, help="stderr lines shown of a failed run")


def main(argv: list[str] | None = None, runner: Runner = run_process) -> int:
    p = argparse.ArgumentParser(description="the overlapped decode loop against the plain one")
    p.add_argument(
        "--cases",
        nargs="+",
        help=f"cases to run, by spaces or commas (default: those --case defines, else "
        f"{' '.join(CASES)})",
    )
    add_run_arguments(p)
    p.add_argument("--repeats", type=int, default=2, help="rounds of both variants per case")
    p.add_argument("--gpu-busy", type=int, default=100, help="profiled loop steps (0: off)")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG of tokens/s per case and variant")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.gpu_busy < 0:
        p.error("--repeats must be >= 1 and --gpu-busy >= 0")
    cases = {**CASES, **dict(args.case)}
    picked = [name for item in args.cases or [] for name in item.split(",") if name]
    names = picked or (list(CASES) if not args.case else [n for n, _ in args.case])
    unknown = [n for n in names if n not in cases]
    if unknown:
        p.error(f"unknown cases {unknown}: known {sorted(cases)}, or define one with --case")
    extra = [a for text in args.extra for a in shlex.split(text)]
    progress = [0, len(names) * len(VARIANTS) * rounds(args)]
    done, failures = {}, {}
    for name in names:
        config, case_args = cases[name]
        done[name] = run_case(name, config, case_args, args, extra, runner, progress)
        if done[name]["failure"]:
            failures[name] = done[name]["failure"]
    results = {name: compare_case(case["runs"]) for name, case in done.items()}
    header = ("case", "variant", *METRICS.values(), "speedup", "tokens equal", "overlap")
    table = print_table(
        "overlapped loop (medians over runs; times in ms)", header, table_rows(results)
    )
    differ = [name for name, r in results.items() if r["tokens_equal"] is False]
    for name in differ:
        print(f"{name}: tokens differ for requests {results[name]['differing_requests']}")
    for name, failure in failures.items():
        print(f"{name}: {failure['variant']} run failed (exit {failure['exit']})")
    for case in done.values():  # the tokens are checked above; the JSON keeps the numbers
        for runs in case["runs"].values():
            for run in runs:
                run.pop("tokens", None)
    write_json(
        args.out,
        {
            "machine": machine(),
            "args": vars(args),
            "table": table,
            "cases": {n: {**done[n], **results[n]} for n in done},
        },
    )
    series = {
        v: [results[n][v]["tokens_per_second"] or float("nan") for n in results] for v in VARIANTS
    }
    if results:
        plot_bars(args.plot, "decode loop: tokens/s", list(results), series, "tokens/s")
    return 1 if differ or failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
