"""``python -m benchmarks``: list the benchmark suite, or run one benchmark by name.

    python -m benchmarks                  every benchmark, by group, with a line each
    python -m benchmarks NAME [ARGS...]   run NAME with its own flags (its main(ARGS))
    python -m benchmarks NAME --help      NAME's flags
    python -m benchmarks step STEP --out DIR
                                          a GPU step: NAME or NAME:VARIANT with the arguments
                                          the benchmark's GPU_STEPS give it, results in DIR

``python -m benchmarks.GROUP.NAME`` runs the same module. ``scripts/gpu_verify.sh STEP``
runs ``step STEP --out $OUT`` on the GPU: a benchmark's steps are declared by the benchmark
(``GPU_STEPS``), not written out a second time in the script.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.registry import closest, listing, step_argv, suite


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "list":
        print(listing())
        return 0
    if argv[0] in ("-h", "--help", "help"):
        print(f"{__doc__.strip()}\n\n{listing()}")
        return 0
    if argv[0] == "step":
        return _step(argv[1:])
    name, args = argv[0], argv[1:]
    benchmarks = suite()
    if name not in benchmarks:
        near = closest(name, benchmarks)
        hint = f"closest: {', '.join(near)}" if near else "python -m benchmarks lists them"
        print(f"no benchmark named {name!r} ({hint})", file=sys.stderr)
        return 2
    # The benchmark sees the arguments as if it ran alone (some read sys.argv as they import,
    # e.g. --smoke to pick Triton's interpreter), and its --help names it.
    sys.argv = [f"python -m benchmarks {name}", *args]
    return int(benchmarks[name].load().main(args) or 0)


def _step(argv: list[str]) -> int:
    """``step STEP --out DIR [--dry-run]``: the benchmark's declared run, printed, then run."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks step",
        description="run a GPU step: a benchmark (NAME) or one of its runs (NAME:VARIANT) "
        "with the arguments its GPU_STEPS declare",
    )
    p.add_argument("step", help="NAME or NAME:VARIANT")
    p.add_argument("--out", required=True, help="the results folder (made if missing)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args = p.parse_args(argv)
    try:
        bench, step_args = step_argv(args.step, args.out)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(shlex.join(["python3", "-m", "benchmarks", bench.name, *step_args]), flush=True)
    if args.dry_run:
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return main([bench.name, *step_args])


if __name__ == "__main__":
    sys.exit(main())
