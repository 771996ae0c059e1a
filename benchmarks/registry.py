"""The benchmark suite: its groups, and each benchmark's name, module and one-line description.

A benchmark is one module of a group folder, ``benchmarks/GROUP/NAME.py``, with a
``main(argv) -> int``; its name is the file's stem (unique across the groups) and its
description the first line of its module docstring, the one source of both. The docstrings
are read with ``ast``, so listing the suite imports none of it: torch, Triton and the GPU
libraries load only when a benchmark runs. ``python -m benchmarks`` lists and runs them.
"""

from __future__ import annotations

import ast
import difflib
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
GROUPS = {
    "host": "The planner's host cost",
    "loop": "The serving loop",
    "kernels": "Kernels against their floors",
    "verify": "GPU verification against the real libraries",
    "soak": "Soaks",
}
"""Each group (a folder of ``benchmarks/``) and its title, in the order they are listed."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    group: str
    path: Path

    @property
    def module(self) -> str:
        """The module to import, or to run as ``python -m``."""
        return f"benchmarks.{self.group}.{self.name}"

    @property
    def description(self) -> str:
        """The first line of the module's docstring ("" where it has none)."""
        doc = ast.get_docstring(ast.parse(self.path.read_text(), filename=str(self.path)))
        return doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


def suite(root: Path = HERE) -> dict[str, Benchmark]:
    """Every benchmark by name, group by group in :data:`GROUPS`' order, names sorted in each.
    Two modules of one name in different groups are refused: a name must say which one runs."""
    found: dict[str, Benchmark] = {}
    for group in GROUPS:
        for path in sorted((root / group).glob("*.py")):
            if path.name.startswith("_"):
                continue
            bench = Benchmark(path.stem, group, path)
            if bench.name in found:
                other = found[bench.name]
                raise ValueError(
                    f"benchmark {bench.name!r} in two groups: {other.group}/ and {group}/"
                )
            found[bench.name] = bench
    return found


def closest(name: str, names: list[str] | dict[str, Benchmark], n: int = 3) -> list[str]:
    """The names most like ``name`` (a misspelling's likely intent), best first."""
    return difflib.get_close_matches(name, list(names), n=n, cutoff=0.5)


def listing(benchmarks: dict[str, Benchmark] | None = None) -> str:
    """The suite as text: each group's title, then ``name  description`` a line each."""
    benchmarks = suite() if benchmarks is None else benchmarks
    width = max((len(name) for name in benchmarks), default=0)
    blocks = []
    for group, title in GROUPS.items():
        rows = [b for b in benchmarks.values() if b.group == group]
        if rows:
            lines = [f"{title} ({group}/)"]
            lines += [f"  {b.name.ljust(width)}  {b.description.replace('``', '')}" for b in rows]
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
