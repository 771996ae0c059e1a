"""Simulated faults: an optional library that will not import, and the warnings said about it."""

from __future__ import annotations

import importlib
import sys


def block_import(monkeypatch, name: str, exc: BaseException) -> None:
    """``import name`` raises ``exc``, as a missing or ABI-broken install does."""
    real = importlib.import_module

    def fake(module: str, package: str | None = None):
        if module == name or module.startswith(name + "."):
            raise exc
        return real(module, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    monkeypatch.delitem(sys.modules, name, raising=False)


def runtime_warnings(caught) -> list[str]:
    """The messages of the ``RuntimeWarning``s among ``caught`` (``warnings.catch_warnings``)."""
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
