"""``docs/backends.md`` tells the truth: its op catalogue lists every shared op of
``backends/common`` (and each in-tree backend's own) with exactly its providers, names no op
that is not registered, and its dimension table names every dimension the planner derives."""

from __future__ import annotations

import re

from planner.ops import all_ops
from planner.settings import DERIVED_DIMS, LAYOUT
from tests.support import REPO

DOC = (REPO / "docs" / "backends.md").read_text()
ROW = re.compile(r"^\| `([a-z_]+)` \|(.*)\| ([a-z_, ]+) \|$", re.M)


def _in_tree() -> dict[str, set[str]]:
    return {
        name: set(op.providers)
        for name, op in all_ops().items()
        if op.providers["torch"].fn.__module__.startswith("backends.")
    }


def test_the_catalogue_lists_every_in_tree_op_with_its_providers():
    listed = {name: set(providers.split(", ")) for name, _, providers in ROW.findall(DOC)}
    ops = _in_tree()
    assert listed == ops


def test_the_shared_ops_are_in_the_shared_table():
    shared = DOC.split("## Shared ops", 1)[1].split("Each in-tree backend's own ops", 1)[0]
    names = {name for name, _, _ in ROW.findall(shared)}
    common = {
        name
        for name, op in all_ops().items()
        if op.providers["torch"].fn.__module__.startswith("backends.common")
    }
    assert names == common


def test_the_dimension_table_names_every_planner_dimension():
    table = DOC.split("### Dimensions", 1)[1].split("### Settings", 1)[0]
    for name in DERIVED_DIMS | LAYOUT | {"next_n"}:
        assert f"`{name}`" in table, name
