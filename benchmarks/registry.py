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
import re
import shlex
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

    @property
    def gpu_steps(self) -> dict[str, str]:
        """The module's ``GPU_STEPS``: its runs as ``scripts/gpu_verify.sh`` steps, by
        variant ("" the plain ``NAME``, ``*`` any other), each its arguments with ``{out}``
        (the results folder), ``{variant}`` and ``{tag}`` (the variant as a file name: a
        device call brings back no file whose name holds a comma); read with ``ast``, as the
        docstring is."""
        tree = ast.parse(self.path.read_text(), filename=str(self.path))
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "GPU_STEPS"
            ):
                return dict(ast.literal_eval(node.value))
        return {}


def step_argv(
    step: str, out: str, benchmarks: dict[str, Benchmark] | None = None
) -> tuple[Benchmark, list[str]]:
    """The benchmark a ``gpu_verify.sh`` step (``NAME`` or ``NAME:VARIANT``) runs, and its
    arguments with the results folder ``out``; a ``ValueError`` naming what exists for a
    step that names no benchmark or no run of it."""
    benchmarks = suite() if benchmarks is None else benchmarks
    name, _, variant = step.partition(":")
    if name not in benchmarks:
        near = closest(name, benchmarks)
        hint = f"closest: {', '.join(near)}" if near else "python -m benchmarks lists them"
        raise ValueError(f"step {step!r}: no benchmark named {name!r} ({hint})")
    bench = benchmarks[name]
    steps = bench.gpu_steps
    args = steps.get(variant, steps.get("*") if variant else None)
    if args is None:
        known = [f"{name}:{v}" if v else name for v in steps] or ["none"]
        raise ValueError(f"step {step!r}: {name} has no such run (its steps: {', '.join(known)})")
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", variant)
    return bench, shlex.split(args.format(out=out, variant=variant, tag=tag))


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
