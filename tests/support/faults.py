"""Simulated faults: the planner setup the fault tests share, an optional library that will not
import, and the warnings said about it."""

from __future__ import annotations

import importlib
import sys

from tests.support.planners import PlannerSetup

FAULTS = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64, pool=9)
"""Small limits; ``planner(device="cuda:0", fake_cuda=True)`` builds and chooses providers
without a GPU."""


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
