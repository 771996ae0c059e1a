"""``python -m benchmarks``: list the benchmark suite, or run one benchmark by name.

    python -m benchmarks                  every benchmark, by group, with a line each
    python -m benchmarks NAME [ARGS...]   run NAME with its own flags (its main(ARGS))
    python -m benchmarks NAME --help      NAME's flags

``python -m benchmarks.GROUP.NAME`` runs the same module. ``scripts/gpu_verify.sh NAME``
runs it on the GPU with the arguments that step gives it (its JSON under ``$OUT``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks.registry import closest, listing, suite


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "list":
        print(listing())
        return 0
    if argv[0] in ("-h", "--help", "help"):
        print(f"{__doc__.strip()}\n\n{listing()}")
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
