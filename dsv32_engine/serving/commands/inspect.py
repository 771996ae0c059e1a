"""``python -m planner inspect DIR``: one plan dump as a table (or JSON), or a run folder's list.

A thin wrapper over :mod:`planner.dumps.inspect`: what it adds is the command line (a
folder of the demo's runs is listed by :mod:`dump_list`) and the one-line failure every
dump reader gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsv32_engine.serving.cli import error_line
from dsv32_engine.serving.commands.dump_list import list_dumps, render_listing
from planner.dumps import (
    INDEX,
    inspect_report,
    load_dump,
    make_console,
    render_dump,
    select_fields,
)
from planner.errors import PlanError


def fail(command: str, exc: BaseException) -> int:
    """A dump that cannot be read: one line (the CLI's prefix, the command), exit status 2."""
    print(
        error_line(f"{command}: {exc}" if str(exc) else f"{command}: {type(exc).__name__}"),
        file=sys.stderr,
    )
    return 2


def run(args: argparse.Namespace) -> int:
    """Render one dump, or list the dumps of a run folder; 0 on success, 2 on a
    missing/corrupt dump or unknown field."""
    root = Path(args.dump)
    if root.is_dir() and not (root / INDEX).is_file():
        found = list_dumps(root)
        if found["dumps"] or found["runs"]:
            if args.json:
                print(json.dumps(found, indent=1))
            else:
                render_listing(found, make_console(sys.stdout))
            return 0
    try:
        dump = load_dump(args.dump)
        select_fields(dump, args.field)  # an unknown field fails here, before any output
    except (PlanError, OSError) as exc:
        return fail("inspect", exc)
    if args.json:  # outside the ``try``: a closed pipe is the CLI's to report, not a failure
        print(json.dumps(inspect_report(dump, args.field, args.full), indent=1, allow_nan=False))
    else:
        render_dump(dump, make_console(sys.stdout), args.field, args.full)
    return 0
