"""The source tree's layers only point down, and the core stays one small planner.

``planner/`` is the core: it imports nothing else of the project (the one exception is
``planner/__main__.py``, which only dispatches ``python -m planner`` to the CLI).
``backends/`` and ``graphs/`` build on the core. The application, ``dsv32_engine/``, is
three layers: ``models`` on the core and the backends, ``distributed`` on the core and
graphs, ``serving`` on anything below it. Every ``.py`` file of those packages is read with
``ast``: its imports (at module level and inside functions, relative ones resolved) must
point down, no function imports a project module (a lazy import hides a dependency, and
a cycle, from this check; optional GPU libraries such as ``deep_gemm`` or ``flashinfer``
may still be imported lazily through ``importlib``). ``benchmarks/`` is no layer (a
benchmark may import anything).

The core is held to its budget (at most 5,500 lines of Python in at most 18 modules, the
``python -m planner`` entry aside) and reaches into no private internals: no ``ctypes``,
no reference counts, no hunting for CUDA symbols, no ``torch._C``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

APP = "dsv32_engine"
"""The application's one top-level name; its sub-packages are layers of their own."""
LAYERS = {
    "planner": set(),
    "backends": {"planner"},
    "graphs": {"planner"},
    APP: set(),
    f"{APP}.models": {"planner", "backends", APP},
    f"{APP}.distributed": {"planner", "graphs", APP},
    f"{APP}.serving": {"planner", "backends", "graphs", APP, f"{APP}.models", f"{APP}.distributed"},
}
"""Each layer (a top-level package, or one of the application's sub-packages) and the
project layers it may import (besides itself)."""
EXCEPTIONS = {"planner/__main__.py": {f"{APP}.serving"}}
"""Modules allowed one more layer: ``python -m planner`` only calls the CLI's ``main``."""
DISPATCH = {"dsv32_engine/serving/cli.py", "planner/__init__.py"}
"""Modules that import by name (``"module:function"`` strings): the CLI its commands, so
that ``--help`` needs no torch, and the core package its public names, on first use (PEP
562). Those names are checked below as the imports they are."""
CORE_LINES = 5500
CORE_MODULES = 18
FORBIDDEN_IN_CORE = (
    "ctypes",
    "getrefcount",
    "_use_count",
    "_storage_Use_Count",
    "/proc/self/maps",
    "torch._C",
)
"""What the core never names: private internals of torch and CPython, and symbol hunting."""
_COMMAND = re.compile(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Import:
    path: str
    """The importing file, relative to the root (posix)."""
    line: int
    module: str
    """The imported module, absolute."""
    text: str
    """What the source says, for the message."""
    in_function: bool = False
    dynamic: bool = False
    """Through ``importlib.import_module`` / ``__import__`` (or a dispatch string)."""


def _module_name(rel: Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports start from)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _resolve(package: str, level: int, module: str | None) -> str:
    base = package.split(".") if package else []
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def imports_of(root: Path, rel: Path) -> list[Import]:
    """Every import in ``root / rel``: statements, dynamic imports and dispatch strings."""
    source = (root / rel).read_text()
    tree = ast.parse(source, filename=str(rel))
    _, package = _module_name(rel)
    path = rel.as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(path, node.lineno, alias.name, ast.unparse(node), in_function))
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(package, node.level, node.module) if node.level else node.module
            # ``from .. import x`` from a top-level package: the names are the modules
            for name in [module] if module else [a.name for a in node.names]:
                found.append(Import(path, node.lineno, name, ast.unparse(node), in_function))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            arg = node.args[0] if node.args else None
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
            found.append(
                Import(path, node.lineno, name, ast.unparse(node), in_function, dynamic=True)
            )
        elif path in DISPATCH and isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _COMMAND.match(node.value)
            if match:
                found.append(Import(path, node.lineno, match[1], repr(node.value), True, True))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def _exists(root: Path, module: str) -> bool:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def layer_of(module: str) -> str | None:
    """The layer a dotted module (or a path's parts joined by dots) belongs to, if any."""
    parts = module.split(".")
    if parts[0] == APP and len(parts) > 1 and f"{APP}.{parts[1]}" in LAYERS:
        return f"{APP}.{parts[1]}"
    return parts[0] if parts[0] in LAYERS else None


def source_files(root: Path) -> list[Path]:
    tops = {layer.split(".")[0] for layer in LAYERS}
    return sorted(p.relative_to(root) for top in tops for p in (root / top).rglob("*.py"))


def violations(root: Path) -> list[str]:
    """``file:line: what`` for every import pointing up or sideways, and every
    function-local import of a project module."""
    found = []
    for rel in source_files(root):
        path = rel.as_posix()
        top = layer_of(".".join(rel.with_suffix("").parts))
        allowed = {top} | LAYERS[top] | EXCEPTIONS.get(path, set())
        for imp in imports_of(root, rel):
            target = layer_of(imp.module)
            where = f"{path}:{imp.line}: `{imp.text}`"
            if imp.dynamic and not imp.module and path not in DISPATCH:
                found.append(f"{where} imports a module it computes: name it, or import it")
            if imp.dynamic and path in DISPATCH and imp.module and not _exists(root, imp.module):
                found.append(f"{where} names a module that does not exist")
            if target is None:
                continue  # the standard library, torch, an optional GPU library
            if target not in allowed:
                found.append(f"{where}: {top} may import {sorted(allowed - {top}) or 'nothing'}")
            if imp.in_function and not (imp.dynamic and path in DISPATCH):
                found.append(f"{where}: a project module imported inside a function")
    return found


def test_every_import_points_down():
    found = violations(REPO)
    assert not found, "layering violations:\n" + "\n".join(found)


def core_budget(root: Path) -> list[str]:
    """What breaks the core's budget: too many lines or modules, a forbidden name."""
    files = [p for p in sorted((root / "planner").rglob("*.py")) if p.name != "__main__.py"]
    found = [
        f"{p.relative_to(root).as_posix()}: not Python"
        for p in (root / "planner").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc")
    ]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    if lines > CORE_LINES:
        found.append(f"planner/: {lines} lines of Python, more than {CORE_LINES}")
    if len(files) > CORE_MODULES:
        found.append(f"planner/: {len(files)} modules, more than {CORE_MODULES}")
    for path in files:
        text = path.read_text()
        for name in FORBIDDEN_IN_CORE:
            if name in text:
                found.append(f"{path.relative_to(root).as_posix()}: names {name!r}")
    return found


def test_the_core_keeps_its_budget_and_no_private_internals():
    found = core_budget(REPO)
    assert not found, "core budget:\n" + "\n".join(found)


def test_the_budget_check_finds_what_it_is_for(tmp_path):
    core = tmp_path / "planner"
    core.mkdir()
    (core / "__main__.py").write_text("x = 1\n" * (CORE_LINES + 1))  # the entry: not counted
    (core / "a.py").write_text("import ctypes\n")
    (core / "b.py").write_text("x = torch._C._cuda_getDevice()\n")
    (core / "screen.c").write_text("int f(void);\n")
    assert core_budget(tmp_path) == [
        "planner/screen.c: not Python",
        "planner/a.py: names 'ctypes'",
        "planner/b.py: names 'torch._C'",
    ]
    for i in range(CORE_MODULES):
        (core / f"m{i}.py").write_text("x = 1\n" * (CORE_LINES // CORE_MODULES + 1))
    found = core_budget(tmp_path)
    assert f"planner/: {CORE_MODULES + 2} modules, more than {CORE_MODULES}" in found
    assert any(f.startswith("planner/: ") and "lines of Python" in f for f in found)


def test_every_top_level_package_has_a_layer():
    """A new top-level package must be given its place in ``LAYERS`` to be checked at all."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    packages |= {f"{APP}.{p.parent.name}" for p in (REPO / APP).glob("*/__init__.py")}
    assert packages == set(LAYERS)


def test_the_check_finds_what_it_is_for(tmp_path):
    """A tree with one violation of each kind: each is named by file, line and import."""
    files = {
        "planner/__init__.py": "",
        "planner/core.py": "import torch\nfrom backends.paged import plan\n",
        "planner/late.py": "def f():\n    from planner import core\n    return core\n",
        "planner/__main__.py": "from dsv32_engine.serving.cli import main\n",
        "backends/__init__.py": "from . import kernels\nfrom ..dsv32_engine import serving\n",
        "graphs/__init__.py": "",
        "dsv32_engine/__init__.py": "",
        "dsv32_engine/models/__init__.py": "import importlib\n\ndef load():\n"
        "    importlib.import_module('flashinfer')\n"
        "    return importlib.import_module('dsv32_engine.serving.engine')\n",
        "dsv32_engine/serving/__init__.py": "import dsv32_engine.models, graphs, backends, planner\n",
        "dsv32_engine/serving/cli.py": "import importlib\n"
        "RUN = 'dsv32_engine.serving.commands.decode:run'\n"
        "GONE = 'dsv32_engine.serving.commands.gone:run'\n\n"
        "def dispatch(module):\n    return importlib.import_module(module)\n",
        "dsv32_engine/serving/commands/decode.py": "",
        "dsv32_engine/serving/other.py": "import importlib\nNAME = 'x'\nimportlib.import_module(NAME)\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    engine_import = "dsv32_engine/models/__init__.py:5: "
    engine_import += "`importlib.import_module('dsv32_engine.serving.engine')`: "
    expected = [
        "planner/core.py:2: `from backends.paged import plan`",
        "planner/late.py:2: `from planner import core`: a project module imported inside",
        "backends/__init__.py:2: `from ..dsv32_engine import serving`",
        engine_import + "dsv32_engine.models may import",
        engine_import + "a project module",
        "dsv32_engine/serving/other.py:3: `importlib.import_module(NAME)` imports a module it",
        "dsv32_engine/serving/cli.py:3: `'dsv32_engine.serving.commands.gone:run'` names a module",
    ]
    for want in expected:
        assert any(v.startswith(want) for v in found), (want, found)
    assert len(found) == len(expected), found  # nothing else: the allowed imports pass
