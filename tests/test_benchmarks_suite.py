"""The benchmark suite is one suite: ``python -m benchmarks`` lists and runs every benchmark.

Each module of a group folder (``benchmarks/GROUP/NAME.py``) is one benchmark: a docstring
whose first line is its one-line description (the listing's, and the only one), a
``main(argv)`` and a ``__main__`` guard, so it runs by name and as ``python -m
benchmarks.GROUP.NAME``. No module is a part of another: besides the groups, ``benchmarks/``
holds only the shared helpers, the registry and the entry point. Listing the suite imports
none of it (torch and the GPU libraries load only when a benchmark runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from benchmarks import __main__ as entry
from benchmarks.registry import GROUPS, closest, listing, suite
from tests.support import REPO

BENCHMARKS = REPO / "benchmarks"
SHARED = {"__main__.py", "common.py", "registry.py"}
"""The modules of ``benchmarks/`` itself: the entry point, the shared helpers, the registry."""
BENCH = suite()


def test_benchmarks_holds_groups_of_benchmarks_and_the_shared_modules_only():
    top = {p.name for p in BENCHMARKS.glob("*.py")}
    assert top == SHARED
    folders = {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(GROUPS)
    modules = {p.resolve() for group in GROUPS for p in (BENCHMARKS / group).glob("*.py")}
    assert {b.path for b in BENCH.values()} == modules  # every module of a group: a benchmark


@pytest.mark.parametrize("name", sorted(BENCH))
def test_every_benchmark_describes_itself_and_runs_by_name(name):
    bench = BENCH[name]
    tree = ast.parse(bench.path.read_text())
    doc = ast.get_docstring(tree)
    assert doc, f"{bench.path}: no module docstring (its first line is the listing's)"
    first = doc.splitlines()[0]
    assert first == bench.description and first.endswith("."), (
        f"{bench.path}: the docstring's first line is the benchmark's one-line description: "
        f"a sentence on one line ({first!r})"
    )
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains and mains[0].args.args[0].arg == "argv", f"{bench.path}: no main(argv)"
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards and "main()" in ast.unparse(guards[0]), f"{bench.path}: no __main__ guard"


def test_names_are_unique_across_groups(tmp_path):
    for group in ("host", "loop"):
        (tmp_path / group).mkdir()
        (tmp_path / group / "same.py").write_text('"""One."""\n')
    with pytest.raises(ValueError, match="'same' in two groups: host/ and loop/"):
        suite(tmp_path)


def test_the_listing_names_every_benchmark_under_its_group():
    text = listing()
    for title in GROUPS.values():
        assert title in text
    for name, bench in BENCH.items():
        assert f"  {name} " in text and bench.description.replace("``", "") in text
    assert text.index(GROUPS["host"]) < text.index("planner_overhead") < text.index(GROUPS["loop"])


def test_listing_imports_no_benchmark():
    code = (
        "import sys; from benchmarks.__main__ import main; main([]); "
        "assert 'torch' not in sys.modules, 'listing imported torch'"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "planner_overhead" in run.stdout


def test_an_unknown_name_is_refused_with_the_closest(capsys):
    assert entry.main(["planner_overhed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'planner_overhed'" in err and "planner_overhead" in err
    assert closest("soak", BENCH) == ["soak_gpu"]


def test_help_and_a_benchmark_run_by_name(capsys, monkeypatch):
    assert entry.main(["--help"]) == 0
    assert "python -m benchmarks NAME" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the entry sets the benchmark's argv
    with pytest.raises(SystemExit) as exc:
        entry.main(["check_distributed", "--help"])
    assert exc.value.code == 0
    assert "usage: python -m benchmarks check_distributed" in capsys.readouterr().out
