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

The core holds one concept per module: each module's docstring names its concept on its
first line, and each file is at most ``MODULE_LINES`` (600) lines long (a file past that
holds two concepts: split it by concept). No total caps the core: a cap on the sum would
reward trimming docstrings and crowding concepts together over naming each one. The core
reaches into no private internals: no
``ctypes``, no reference counts, no hunting for CUDA symbols, no ``torch._C``.
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
MODULE_LINES = 600
"""A core file past this many lines is two concepts in one file: split it by concept."""
OVER_THE_LINE: dict[str, int] = {}
"""Core files let past ``MODULE_LINES`` while they are split by concept, each held to its
size: one may shrink, never grow, and leaves this list once under the line. None today."""
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


def core_rules(root: Path, over_the_line: dict[str, int] = OVER_THE_LINE) -> list[str]:
    """What breaks the core's rules: a file that is not Python, a module without a docstring
    naming its concept, a file past its line count, a forbidden name; and an entry of
    ``over_the_line`` that is gone or back under the line (take it off the list)."""
    core = root / "planner"
    found = [
        f"{p.relative_to(root).as_posix()}: not Python"
        for p in sorted(core.rglob("*"))
        if p.is_file() and p.suffix not in (".py", ".pyc")
    ]
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text, filename=rel), clean=False) or ""
        if not docstring.strip() or not docstring.splitlines()[0].strip():
            found.append(f"{rel}: no module docstring naming its concept on its first line")
        lines = len(text.splitlines())
        limit = over_the_line.get(rel, MODULE_LINES)
        if lines > limit:
            held = " (held to its size until it is split)" if rel in over_the_line else ""
            found.append(f"{rel}: {lines} lines, more than {limit}{held}: split it by concept")
        elif rel in over_the_line and lines <= MODULE_LINES:
            found.append(f"{rel}: {lines} lines, under {MODULE_LINES}: take it off OVER_THE_LINE")
        for name in FORBIDDEN_IN_CORE:
            if name in text:
                found.append(f"{rel}: names {name!r}")
    for rel in over_the_line:
        if not (root / rel).is_file():
            found.append(f"{rel}: gone: take it off OVER_THE_LINE")
    return found


def test_the_core_keeps_one_concept_per_module_and_no_private_internals():
    found = core_rules(REPO)
    assert not found, "core rules:\n" + "\n".join(found)


def test_the_core_rules_find_what_they_are_for(tmp_path):
    core = tmp_path / "planner"
    (core / "dumps").mkdir(parents=True)
    concept = '"""One concept."""\n'
    (core / "__main__.py").write_text(concept + "import ctypes\n")
    (core / "b.py").write_text(concept + "x = torch._C._cuda_getDevice()\n")
    (core / "screen.c").write_text("int f(void);\n")
    (core / "bare.py").write_text("x = 1\n")
    (core / "blank.py").write_text('"""\nThe summary line is empty."""\n')
    (core / "dumps" / "long.py").write_text(concept + "x = 1\n" * MODULE_LINES)
    (core / "fits.py").write_text(concept + "x = 1\n" * (MODULE_LINES - 1))  # 600: fine
    (core / "held.py").write_text(concept + "x = 1\n" * 700)  # 701, held to 701: fine
    (core / "grew.py").write_text(concept + "x = 1\n" * 700)  # 701, held to 700
    (core / "shrank.py").write_text(concept + "x = 1\n" * 10)
    held = {
        "planner/held.py": 701,
        "planner/grew.py": 700,
        "planner/shrank.py": 650,
        "planner/gone.py": 650,
    }
    assert core_rules(tmp_path, held) == [
        "planner/screen.c: not Python",
        "planner/__main__.py: names 'ctypes'",
        "planner/b.py: names 'torch._C'",
        "planner/bare.py: no module docstring naming its concept on its first line",
        "planner/blank.py: no module docstring naming its concept on its first line",
        "planner/dumps/long.py: 601 lines, more than 600: split it by concept",
        "planner/grew.py: 701 lines, more than 700 (held to its size until it is split): "
        "split it by concept",
        "planner/shrank.py: 11 lines, under 600: take it off OVER_THE_LINE",
        "planner/gone.py: gone: take it off OVER_THE_LINE",
    ]


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
