"""Simulated faults: the planner setup the fault tests share, an optional library that will not
import, and the warnings said about it."""

from __future__ import annotations

import dataclasses
import importlib
import sys

from planner.ops import get_op
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


def break_host_twin(monkeypatch, op_name: str = "cumsum_with_zero") -> list[int]:
    """``op_name``'s numpy host twin raises on every call; the list its calls are counted in."""
    op = get_op(op_name)
    calls: list[int] = []

    def broken(out, *args, **params):
        calls.append(1)
        raise FloatingPointError("twin bug")

    monkeypatch.setitem(op.providers, "numpy", dataclasses.replace(op.host, fn=broken))
    return calls
