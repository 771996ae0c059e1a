"""Every ``examples/*.py`` runs, from the checkout and from outside it.

The examples are the README's code: an example that no longer runs is a README that lies.
Each runs twice: as its own process with the repository root as the working directory and
on ``PYTHONPATH`` (the checkout's sources), and, all in one child process, from a fresh
temporary directory with ``PYTHONPATH`` unset (the installed package, as an engine author
would import it). Each example ends by printing ``<its file's stem>: ok``, the line checked
here, so a new example is covered by adding the file. Sub-folders (``examples/plugin/``, a
package with tests of its own) are not scripts and are not globbed.

Every example uses the library alone (``planner``, ``backends``, ``graphs``): run in one
child, none of them imports a ``dsv32_engine`` module, directly or through the library, so
what they show is what an engine that adopts the library can do without the demo.

The README's Python snippets are held to the examples too: a snippet is either an excerpt
whose first line names its ``examples/`` files (each of its lines must be a line of them)
or a script that runs as shown.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.support import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.py"))
TIMEOUT_S = 120
"""Far above the few seconds each takes on 2 cores: a hang fails, a slow machine does not."""


def _env(*, checkout: bool) -> dict[str, str]:
    """The child's environment: one thread (the tests' pin), no planner switches inherited
    from the caller, and the checkout on ``PYTHONPATH`` only when asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANNER_")}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = str(REPO)
    return env


def _run(path: Path, cwd: Path, *, checkout: bool) -> subprocess.CompletedProcess[str]:
    """The example as its own process: ``python examples/NAME.py``."""
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=cwd,
        env=_env(checkout=checkout),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _check(path: Path, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{path.name} exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert f"{path.stem}: ok" in done.stdout.splitlines(), done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"plan_a_batch.py", "graph_replay.py", "dump_plans.py"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_in_the_checkout(path):
    _check(path, _run(path, REPO, checkout=True))


DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        code, err = 1, io.StringIO(err.getvalue() + traceback.format_exc())
    results[path] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""
"""Runs each example as ``__main__`` in one child: the outside pass pays torch's import once."""


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every example run once from a directory outside the checkout, ``PYTHONPATH`` unset: the
    installed package's imports (skipped where forward-planner is not installed)."""
    try:
        metadata.distribution("forward-planner")
    except metadata.PackageNotFoundError:
        pytest.skip("forward-planner is not installed in this interpreter (pip install -e .)")
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, EXAMPLES)],
        cwd=tmp_path_factory.mktemp("outside"),
        env=_env(checkout=False),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * max(len(EXAMPLES), 1),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {
        path: subprocess.CompletedProcess([path], code, out, err)
        for path, (code, out, err) in results.items()
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_from_outside_the_checkout(path, outside):
    _check(path, outside[str(path)])


# ---- the library alone ------------------------------------------------------------------------

APP = "dsv32_engine"
"""The demo application: no example may import it."""
APP_MODULES = """
import contextlib, io, json, runpy, sys
app, found, seen = sys.argv[1], {}, set()
for path in sys.argv[2:]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(BaseException):
        runpy.run_path(path, run_name="__main__")  # whether it runs is the tests' above
    loaded = {m for m in sys.modules if m.partition(".")[0] == app}
    found[path], seen = sorted(loaded - seen), seen | loaded
print(json.dumps(found))
"""
"""Runs each script as ``__main__`` in one child, in order, and names the application's
modules each one imported first (the first argument is the application's name)."""


def test_examples_use_the_library_alone(tmp_path):
    """No example imports the demo application, not even through the library; a probe that
    does (run last) shows the check sees an import of it."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"import {APP}.serving.cli\n")
    done = subprocess.run(
        [sys.executable, "-c", APP_MODULES, APP, *map(str, EXAMPLES), str(probe)],
        cwd=REPO,
        env=_env(checkout=True),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * (len(EXAMPLES) + 1),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert f"{APP}.serving.cli" in found.pop(str(probe))
    assert found == {str(p): [] for p in EXAMPLES}, "examples importing the application"


# ---- the README's Python snippets -------------------------------------------------------------

README = REPO / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SOURCE = re.compile(r"examples/[\w/]+\.py")


def _snippets() -> list[str]:
    return FENCE.findall(README.read_text(encoding="utf-8"))


def _code_lines(snippet: str) -> list[str]:
    """The snippet's lines as they must appear in its example, stripped (indentation aside)."""
    return [line.strip() for line in snippet.splitlines() if line.strip()]


def test_readme_has_snippets():
    assert len(_snippets()) >= 4


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs_or_is_an_example_excerpt(index, tmp_path):
    """A snippet whose first line names ``examples/...py`` files is an excerpt: each of its
    lines is a line of one of them. Any other snippet runs as shown, outside the checkout."""
    snippet = _snippets()[index]
    first = snippet.splitlines()[0]
    sources = SOURCE.findall(first) if first.startswith("#") else []
    if sources:
        known: set[str] = set()
        for name in sources:
            known |= set(_code_lines((REPO / name).read_text(encoding="utf-8")))
        missing = [line for line in _code_lines(snippet)[1:] if line not in known]
        assert not missing, f"README lines not in {sources}: {missing}"
        return
    script = tmp_path / "snippet.py"
    script.write_text(snippet, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(checkout=True),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"README snippet {index} failed:\n{snippet}\n{done.stderr[-3000:]}"
