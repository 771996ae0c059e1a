"""The ``triton`` marker is the one switch for the tests of our Triton kernels.

CI runs the suite twice: without Triton, where those tests must skip, then with it and
``-m "triton and not slow"``, where they must all be selected. A test that skipped for want
of Triton some other way (its own ``skipif``, an ``if`` then ``pytest.skip``) would run in
neither. An unmarked test that launches a kernel with no such skip fails the first run
outright (the launchers refuse without Triton), so the rules below, read from the source
with ``ast``, close the gap:

1. No test asks by itself whether Triton can run: no call of ``triton_available``,
   ``triton_usable`` or ``find_spec("triton")``. Only conftest asks, for the marker.
2. ``pytest.importorskip("triton")`` (for a module that uses triton's own names) stands at
   module level only, and that module's ``pytestmark`` carries ``pytest.mark.triton``.
3. A test module that imports Triton, or a Triton module or name of ours (a dotted part
   with ``triton`` in it: ``backends.common.triton_kernels``, ``*_triton``), carries
   ``pytest.mark.triton`` somewhere.

A module marked ``gpu`` as a whole (tests/gpu) is exempt from 2 and 3: it runs only under
``-m gpu`` on CUDA, where its ``importorskip`` is the skip it needs.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ASKS = ("triton_available", "triton_usable")
"""Functions that answer "can Triton run here?": the marker's question, conftest's alone."""
NO_KERNEL = {
    "backends/test_triton_launch.py": "the launcher's pure-Python keys and hook checks",
}
"""Test modules that import Triton code yet launch no kernel, so they run without Triton
(the CI run without it proves the claim: a launch there fails)."""


def triton_marker_problems(root: Path) -> list[str]:
    """Every breach of the rules above in the ``.py`` files under ``root``, as
    ``path:line: what``; conftest.py, the one place that asks, aside."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root).as_posix()
        test_module = path.name.startswith("test_") and where not in NO_KERNEL
        problems += [f"{where}:{line}: {what}" for line, what in _breaches(tree, test_module)]
    return problems


def _breaches(tree: ast.Module, test_module: bool) -> list[tuple[int, str]]:
    module_marks = [ast.unparse(node.value) for node in tree.body if _assigns_pytestmark(node)]
    whole_gpu = any("pytest.mark.gpu" in mark for mark in module_marks)
    module_triton = any("pytest.mark.triton" in mark for mark in module_marks)
    at_module_level = {
        id(node)
        for statement in tree.body
        if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for node in ast.walk(statement)
    }
    found, imports_triton, marked = [], [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.triton":
            marked = True
        elif isinstance(node, ast.Import | ast.ImportFrom) and _imports_triton(node):
            imports_triton.append(node.lineno)
        elif isinstance(node, ast.Call):
            callee = ast.unparse(node.func).rsplit(".", 1)[-1]
            first = node.args[0] if node.args else None
            of_triton = isinstance(first, ast.Constant) and str(first.value).startswith("triton")
            if callee in ASKS or (callee == "find_spec" and of_triton):
                found.append((node.lineno, f"asks whether Triton runs ({callee}): mark the test"))
            elif callee == "importorskip" and of_triton and not whole_gpu:
                if id(node) not in at_module_level:
                    found.append((node.lineno, "importorskip('triton') inside a test: mark it"))
                elif not module_triton:
                    found.append((node.lineno, "importorskip('triton') with no module-level "
                                  "pytestmark carrying pytest.mark.triton"))  # fmt: skip
    if test_module and imports_triton and not marked and not whole_gpu:
        found.append((imports_triton[0], "imports Triton code, but no test carries the mark"))
    return found


def _imports_triton(node: ast.Import | ast.ImportFrom) -> bool:
    """``import triton``, ``from backends.common import triton_kernels``, ``from
    backends.nsa.topk_triton import ...``: a dotted part with ``triton`` in it."""
    names = [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        names.append(node.module or "")
    return any("triton" in part for name in names for part in name.split("."))


def _assigns_pytestmark(node: ast.stmt) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else []
    return any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets)


def test_the_suite_skips_for_want_of_triton_only_through_the_marker() -> None:
    assert triton_marker_problems(TESTS) == []
    assert [name for name in NO_KERNEL if not (TESTS / name).is_file()] == []


BREACHES = {
    "unmarked_kernel_test": """
        from backends.common.triton_kernels import cumsum_with_zero

        def test_kernel():
            cumsum_with_zero(None, None)
    """,
    "own_skipif": """
        import pytest
        import torch
        from backends.common import triton_kernels as tk

        @pytest.mark.triton
        @pytest.mark.skipif(not tk.triton_available(torch.device("cpu")), reason="no")
        def test_kernel():
            pass
    """,
    "skip_inside": """
        import importlib.util
        import pytest

        def test_kernel():
            if importlib.util.find_spec("triton") is None:
                pytest.skip("no triton")
    """,
    "importorskip_unmarked": """
        import pytest

        triton = pytest.importorskip("triton")

        def test_jit():
            assert triton.jit
    """,
    "importorskip_in_a_test": """
        import pytest

        pytestmark = pytest.mark.triton

        def test_jit():
            pytest.importorskip("triton")
    """,
}


@pytest.mark.parametrize("source", BREACHES.values(), ids=BREACHES)
def test_each_way_round_the_marker_is_caught(tmp_path: Path, source: str) -> None:
    (tmp_path / "test_breach.py").write_text(_dedent(source))
    problems = triton_marker_problems(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("test_breach.py:"), problems


def test_marked_modules_and_gpu_modules_pass(tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(
        _dedent("""
        import pytest
        from backends.common import ragged_triton as tri

        triton = pytest.importorskip("triton")
        pytestmark = [pytest.mark.triton]

        def test_kernel():
            tri.token_request(None, None, 0)
        """)
    )
    (tmp_path / "test_mixed.py").write_text(
        _dedent("""
        import pytest
        from backends.nsa.topk_triton import row_topk_triton

        @pytest.mark.parametrize("p", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
        def test_kernel(p):
            pass
        """)
    )
    (tmp_path / "test_on_cuda.py").write_text(
        _dedent("""
        import pytest

        pytestmark = pytest.mark.gpu
        pytest.importorskip("triton")
        from dsv32_engine.models.layers.norm_triton import rms_norm_triton
        """)
    )
    assert triton_marker_problems(tmp_path) == []


def _dedent(source: str) -> str:
    return textwrap.dedent(source).lstrip()
