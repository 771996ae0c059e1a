"""``python -m planner diff A B``: what differs between two plan dumps, field by field.

A thin wrapper over :mod:`planner.dumps.diff`: what it adds is the command line, one
argument naming a mismatch directory (``replayed/`` and ``eager/``, as the demo's debug
hook writes it), and the exit status: 0 when equal, 1 when they differ, 2 on error, so
scripts can branch on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsv32_engine.serving.commands.inspect import fail
from planner.dumps import diff_dumps, diff_report, differing, load_dump, make_console, render_diff
from planner.errors import PlanError


def _pair(a: str, b: str | None) -> tuple[Path, Path]:
    if b is not None:
        return Path(a), Path(b)
    root = Path(a)
    if (root / "replayed").is_dir() and (root / "eager").is_dir():
        return root / "replayed", root / "eager"
    raise PlanError(
        f"diff needs two dumps, or one mismatch directory holding replayed/ and eager/: {root}"
    )


def run(args: argparse.Namespace) -> int:
    """Compare two dumps; 0 equal, 1 different, 2 on error."""
    try:
        path_a, path_b = _pair(args.a, args.b)
        a, b = load_dump(path_a), load_dump(path_b)
    except (PlanError, OSError) as exc:
        return fail("diff", exc)
    diffs = diff_dumps(a, b)
    pointers = getattr(args, "pointers", False)
    if args.json:
        print(json.dumps(diff_report(a, b, diffs, pointers), indent=1, allow_nan=False))
    else:
        render_diff(a, b, diffs, make_console(sys.stdout), pointers)
    return 1 if differing(diffs, pointers) else 0
