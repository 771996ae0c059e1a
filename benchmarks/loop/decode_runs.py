"""The decode CLI on the shipped configs: tokens/s, step p50/p99, TTFT, replays and fallbacks.

Each named case is one run of ``python -m planner decode --config CONFIG --quiet --json
OUT/CASE.json ARGS`` in a fresh process, one case after the other (timings never run side by
side). The table gives per case tokens/s, the decode step's p50 and p99, the time to first
token's p50, graph replays (ragged ones apart) and eager fallbacks; ``OUT/decode_runs.json``
holds every case's summary beside each run's own ``OUT/CASE.json``. A run that fails is
reported with its stderr's tail, the other cases still run, and the exit status is 1.

Cases (``--cases`` picks them, comma- or space-separated; default ``small shapes``):

* ``small``: dsv32-small, 16 requests; ``shapes``: dsv32-shapes (61 layers), 64 requests;
* ``shapes_off``: shapes' run with prompt chunks eager and apart (ragged graphs and mixing
  off: KV capacity, capture time and graph memory beside shapes');
* ``small_fi``, ``shapes_fi``: small and shapes with FlashInfer's sparse MLA kernel;
* ``arrivals_off``, ``arrivals_on``: dsv32-small-arrivals prefill-first, then with the
  defaults, mixed under ragged graphs (``arrivals`` names both);
* ``seed_off``, ``seed_on``: a seed-like workload on dsv32-shapes (32 requests, prompts of
  2-6k tokens, 16 at once, 2,048-token steps), the same two ways (``seed``);
* ``arrivals_debug``: the defaults' run with ``--debug`` (every replay checked against a
  fresh plan), 60 requests: a correctness run;
* ``arrivals_mtp_off``, ``arrivals_mtp_apart``, ``arrivals_mtp_mixed``: dsv32-small-arrivals
  with the MTP draft (4 rows per verify): under the defaults before issue 55 (prompt chunks
  eager and apart from the verify graph step), its prompt chunks in ragged graphs but apart
  (``loop.mixed=false``), then its verify rows mixed into the chunks' steps under ragged
  graphs (``arrivals_mtp`` names the three; issue 55's goal: mixed >= 1.3x without mixing);
* ``arrivals_mtp_wide``: the mixed run with a 768-token step budget, 512 plus 4 verify rows
  for each of 64 decoding requests: apart's prompt pace beside the verify rows (the budget
  counts them; at 512 a full decode leaves the prompts 256);
* ``arrivals_mtp_invariant``: the mixed run in the batch-invariant mode with
  ``--compare-plain``, 60 requests: speculative greedy must equal plain greedy for every
  request (the table's ``spec == plain``).

    python3 -m benchmarks decode_runs --out "$OUT"                      # small, shapes
    python3 -m benchmarks decode_runs --cases arrivals --out "$OUT"     # both arrivals runs
    python3 -m benchmarks decode_runs --cases arrivals_mtp,arrivals_mtp_invariant --out "$OUT"

A CPU smoke run of the plumbing::

    python3 -m benchmarks decode_runs --case 'tiny=dsv32-tiny:--requests 2' --extra='--device cpu'
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import machine, print_table, write_json
from benchmarks.loop.overlap_loop import (
    Runner,
    add_run_arguments,
    command,
    read_run,
    run_decode,
    run_process,
)

GPU_STEPS = {
    "": "--cases small,shapes --out {out}",
    "*": "--cases {variant} --out {out}",
}

OFF = ["--set", "graphs.ragged=false", "--set", "loop.mixed=false"]
"""Prompt chunks eager and apart from the decodes: the defaults before issue 55 (now on CUDA
ragged graphs and mixing are on)."""
SEED = ["--requests", "32", "--set", "loop.prompt_len=[2048,6144]", "--set", "planner.max_batch=16"]
"""A seed-like workload: 32 requests, prompts of 2-6k tokens, 16 at once, 2,048-token steps."""
MTP = ["--draft", "mtp", "--set", "graphs.ragged=true"]
"""The MTP draft (``speculative.draft_tokens`` 4) with prompt chunks in token buckets."""
CASES: dict[str, tuple[str, list[str]]] = {
    "small": ("dsv32-small", ["--requests", "16"]),
    "shapes": ("dsv32-shapes", ["--requests", "64"]),
    "shapes_off": ("dsv32-shapes", ["--requests", "64", *OFF]),
    "small_fi": ("dsv32-small", ["--requests", "16", "--mla-kernel", "flashinfer"]),
    "shapes_fi": ("dsv32-shapes", ["--requests", "64", "--mla-kernel", "flashinfer"]),
    "arrivals_off": ("dsv32-small-arrivals", OFF),
    "arrivals_on": ("dsv32-small-arrivals", []),
    "arrivals_debug": ("dsv32-small-arrivals", ["--requests", "60", "--debug"]),
    "seed_off": ("dsv32-shapes", [*SEED, *OFF]),
    "seed_on": ("dsv32-shapes", SEED),
    "arrivals_mtp_off": ("dsv32-small-arrivals", ["--draft", "mtp", *OFF]),
    "arrivals_mtp_apart": ("dsv32-small-arrivals", [*MTP, "--set", "loop.mixed=false"]),
    "arrivals_mtp_mixed": ("dsv32-small-arrivals", [*MTP, "--set", "loop.mixed=true"]),
    "arrivals_mtp_wide": (
        "dsv32-small-arrivals",
        [*MTP, "--set", "loop.mixed=true", "--set", "loop.chunk_tokens=768"],
    ),
    "arrivals_mtp_invariant": (
        "dsv32-small-arrivals",
        [*MTP, "--set", "loop.mixed=true", "--batch-invariant", "--compare-plain"]
        + ["--requests", "60"],
    ),
}
"""Each case: name -> (config, the case's own arguments to the decode CLI)."""
GROUPS = {
    "arrivals": ("arrivals_off", "arrivals_on"),
    "seed": ("seed_off", "seed_on"),
    "arrivals_mtp": ("arrivals_mtp_off", "arrivals_mtp_apart", "arrivals_mtp_mixed"),
}
"""Names that stand for several cases, run in this order."""
DEFAULT = ("small", "shapes")
COUNTS = ("graph_replays", "ragged_replays", "eager_fallbacks")
"""The summary's counts kept beside :func:`overlap_loop.read_run`'s metrics (a count by kind
or size is summed)."""


def case_names(texts: Sequence[str], groups: Mapping[str, Sequence[str]] = GROUPS) -> list[str]:
    """``--cases`` words (each comma-separated) as case names, groups expanded, in order and
    each once."""
    names: list[str] = []
    for text in texts:
        for word in filter(None, (w.strip() for w in text.split(","))):
            for name in groups.get(word, (word,)):
                if name not in names:
                    names.append(name)
    return names


def add_case_arguments(p: argparse.ArgumentParser, known: Sequence[str], default: str) -> None:
    """``--cases`` (comma- or space-separated; ``default`` names what runs without it, and
    ``known`` what may be named) and :func:`overlap_loop.add_run_arguments`'s flags."""
    p.add_argument(
        "--cases",
        nargs="+",
        default=[],
        help=f"cases to run (default: those --case defines, else {default}); "
        f"known: {', '.join(known)}",
    )
    add_run_arguments(p)


@contextmanager
def results_dir(out: str | None, prefix: str) -> Iterator[Path]:
    """``out`` made if missing, or a temporary folder removed after the runs."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = Path(out or tmp)
        path.mkdir(parents=True, exist_ok=True)
        yield path


def chosen_cases(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    known: Mapping[str, tuple[str, list[str]]],
    default: Sequence[str],
    groups: Mapping[str, Sequence[str]] = GROUPS,
) -> tuple[list[str], dict[str, tuple[str, list[str]]], list[str]]:
    """What a benchmark's run of the decode CLI per case was asked for: the case names
    (``--cases``, groups expanded; else those ``--case`` defines; else ``default``), every
    case it knows (``known`` and ``--case``'s) and the arguments ``--extra`` adds to each
    run. An unknown name is a usage error that lists the known ones."""
    cases = {**known, **dict(args.case)}
    names = case_names(args.cases, groups) or (
        [n for n, _ in args.case] if args.case else list(default)
    )
    unknown = [n for n in names if n not in cases]
    if unknown:
        p.error(f"unknown cases {unknown}: known {[*cases, *groups]}, or define one with --case")
    return names, cases, [a for text in args.extra for a in shlex.split(text)]


def total(value: Any) -> int | None:
    """A count, or the sum of a count by kind or size (``{}``: 0)."""
    if isinstance(value, dict):
        return sum(int(v) for v in value.values())
    return None if value is None else int(value)


def read_summary(payload: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of a run's ``--json`` file: :func:`read_run`'s metrics (tokens
    not kept: one run has nothing to compare them with), the replay and fallback counts, and
    under speculation its mean accept length, its verify rounds mixed with prompt chunks and,
    with ``--compare-plain``, whether its tokens equal plain greedy's (``spec_equals_plain``)."""
    run = read_run(payload)
    run.pop("tokens")
    summary = payload["summary"]
    run.update({key: total(summary.get(key)) for key in COUNTS})
    run["requests_finished"] = summary.get("requests_finished")
    spec = summary.get("speculative") or {}
    run["mean_accept_length"] = spec.get("mean_accept_length")
    run["mixed_verify_steps"] = spec.get("mixed_verify_steps")
    run["spec_equals_plain"] = (summary.get("plain") or {}).get("tokens_equal")
    return run


def table_rows(results: dict[str, dict[str, Any]]) -> list[tuple]:
    rows = []
    for name, result in results.items():
        s = result["summary"] or {}
        cells = [s.get(k) for k in ("tokens_per_second", "step_ms_p50", "step_ms_p99")]
        cells += [s.get(k) for k in ("ttft_ms_p50", *COUNTS)]
        cells += [s.get(k) for k in ("mean_accept_length", "spec_equals_plain")]
        failure = result["failure"]
        if failure:
            status = f"FAILED (exit {failure['exit']})"
        else:
            status = "interrupted" if s.get("interrupted") else "ok"
        rows.append((name, result["config"], *("-" if c is None else c for c in cells), status))
    return rows


def run_cases(
    names: Sequence[str],
    cases: dict[str, tuple[str, list[str]]],
    out: Path,
    args: argparse.Namespace,
    extra: Sequence[str],
    runner: Runner,
) -> dict[str, dict[str, Any]]:
    """Each case's run, one after the other; ``OUT/CASE.json`` is the run's own file."""
    results = {}
    for k, name in enumerate(names):
        config, case_args = cases[name]
        print(f"[{k + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
        path = out / f"{name}.json"
        cmd = command(config, case_args, None, path, 0, extra)
        payload, failure = run_decode(cmd, path, runner, args.timeout, args.tail, name)
        results[name] = {
            "config": config,
            "args": list(case_args),
            "command": shlex.join(cmd),
            "summary": None if payload is None else read_summary(payload),
            "failure": failure,
        }
    return results


def main(argv: Sequence[str] | None = None, runner: Runner = run_process) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(p, [*CASES, *GROUPS], ",".join(DEFAULT))
    p.add_argument("--out", help="folder for each run's CASE.json and decode_runs.json")
    args = p.parse_args(argv)
    names, cases, extra = chosen_cases(p, args, CASES, DEFAULT)
    with results_dir(args.out, "decode_runs-") as out:
        results = run_cases(names, cases, out, args, extra, runner)
    header = ("case", "config", "tok/s", "step p50", "step p99", "ttft p50")
    header += ("replays", "ragged", "eager fallbacks", "accept", "spec == plain", "status")
    table = print_table("decode runs (times in ms)", header, table_rows(results))
    if args.out:
        payload = {"machine": machine(), "args": vars(args), "table": table, "cases": results}
        write_json(str(Path(args.out) / "decode_runs.json"), payload)
    return 1 if any(r["failure"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
