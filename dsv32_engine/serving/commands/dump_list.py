"""``python -m planner inspect DIR`` on a folder of dumps: what it holds, one line each.

A decode run dumps into ``DUMP_DIR/run-NNNN/`` (``step-NNNNNN`` dumps, and
``mismatches/mismatch-N`` when a debug check failed); ``inspect`` on the run folder lists
them, and on the dump directory lists its runs. Only each dump's ``dump.json`` is read
(``inspect`` on one dump checks all of it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from planner.dumps import INDEX

_STEP = re.compile(r"^step-\d+$")
_MISMATCH = re.compile(r"^mismatch-\d+$")
_RUN = re.compile(r"^run-\d+$")


def _index(path: Path) -> dict[str, Any]:
    """What a listing shows of one dump: its step, label and time, or why it cannot."""
    try:
        data = json.loads((path / INDEX).read_text())
        return {"step": data.get("step"), "label": data.get("label"), "created": data["created"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"unreadable {INDEX}: {type(exc).__name__}"}


def _step_dumps(root: Path) -> list[dict[str, Any]]:
    return [
        {"name": entry.name, "kind": "step", **_index(entry)}
        for entry in sorted(root.iterdir())
        if _STEP.match(entry.name) and (entry / INDEX).is_file()
    ]


def _mismatches(root: Path) -> list[dict[str, Any]]:
    found = []
    for folder in (root, root / "mismatches"):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if _MISMATCH.match(entry.name) and (entry / "replayed" / INDEX).is_file():
                name = str(entry.relative_to(root))
                found.append({"name": name, "kind": "mismatch", **_index(entry / "replayed")})
    return found


def list_dumps(root: Path) -> dict[str, Any]:
    """The step dumps and mismatches in ``root``, and its ``run-NNNN`` folders."""
    runs = [
        {"name": entry.name, "dumps": len(_step_dumps(entry)) + len(_mismatches(entry))}
        for entry in sorted(root.iterdir())
        if _RUN.match(entry.name) and entry.is_dir()
    ]
    return {"path": str(root), "dumps": _step_dumps(root) + _mismatches(root), "runs": runs}


def render_listing(found: dict[str, Any], console: Console) -> None:
    root = found["path"]
    dumps, runs = found["dumps"], found["runs"]
    steps = sum(d["kind"] == "step" for d in dumps)
    console.print(
        Text(
            f"{root}: {steps} step dumps, {len(dumps) - steps} mismatches, {len(runs)} runs",
            style="bold",
        )
    )
    for dump in dumps:
        detail = dump.get("error")
        if detail is None:
            label = dump["label"]
            step = "-" if dump["step"] is None else dump["step"]
            named = f", '{label}'" if label and label != f"step {step}" else ""
            detail = f"step {step}{named}, created {dump['created']}"
        console.print(Text(f"  {dump['name']}  {detail}"))
    for run in runs:
        console.print(Text(f"  {run['name']}/  {run['dumps']} dumps"))
    steps_only = [d for d in dumps if d["kind"] == "step"]
    if steps_only:
        last = steps_only[-1]["name"]
        console.print(Text(f"show one with: python -m planner inspect {root}/{last}"))
    if len(steps_only) < len(dumps):
        last = dumps[-1]["name"]
        console.print(Text(f"compare a mismatch with: python -m planner diff {root}/{last}"))
    if not dumps and runs:
        console.print(Text(f"list a run with: python -m planner inspect {root}/{runs[-1]['name']}"))
