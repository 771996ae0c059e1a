"""What ``backends``, ``schema`` and ``ops`` show: every plan of a backend, labelled by the
forward modes it serves (NSA's decode plan, with its ``paged_mqa_schedule`` field, not only the
extend plan registered first), the metadata ops with their providers, and names never cut.

All in-process through ``serving.cli.main`` (stdout captured: not a terminal).
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from dsv32_engine.serving.cli import main
from dsv32_engine.serving.commands import backends as backends_command
from planner.batch import ForwardMode
from planner.registry import all_plan_classes, backend_plans


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _modes_planned(backend: str) -> set[str]:
    """The modes a backend's schemas declare, idle aside (it runs decode's plan)."""
    return {
        m.value for cls in backend_plans(backend) for m in cls.modes if m is not ForwardMode.IDLE
    }


def test_schema_is_keyed_by_every_mode_and_shows_the_decode_plan(capsys):
    schemas = json.loads(_run(capsys, "schema", "nsa"))
    assert set(schemas) == _modes_planned("nsa")
    decode = schemas["decode"]
    assert decode["title"] == "NSAPlan"
    assert decode["properties"]["schedule"]["plan"]["op"] == "paged_mqa_schedule"
    assert schemas["target_verify"] == decode  # one class plans both
    assert schemas["extend"]["title"] == "NSAExtendPlan"
    assert schemas["draft_extend"]["title"] == "NSADraftExtendPlan"
    assert "schedule" not in schemas["extend"]["properties"]


def test_schema_mode_prints_that_plan_alone(capsys):
    everything = json.loads(_run(capsys, "schema", "nsa"))
    for mode in everything:
        assert json.loads(_run(capsys, "schema", "nsa", "--mode", mode)) == everything[mode]


@pytest.mark.parametrize("backend", sorted(all_plan_classes()))
def test_schema_of_every_backend_covers_its_modes(backend, capsys):
    assert set(json.loads(_run(capsys, "schema", backend))) == _modes_planned(backend)


def test_backends_json_labels_every_plan_by_mode(capsys):
    rows = json.loads(_run(capsys, "backends", "--json"))
    plans = {(r["backend"], r["plan"]): r["modes"] for r in rows}
    for backend, classes in all_plan_classes().items():
        for cls in classes:
            if backend.startswith("test-"):
                continue  # other tests' throwaway schemas, some built once per process
            if any(spec.op for spec in cls.tensor_specs.values()):
                assert set(plans[(backend, cls.__name__)]) == {m.value for m in cls.modes}
    (schedule,) = [r for r in rows if r["plan"] == "NSAPlan" and r["field"] == "schedule"]
    assert schedule["op"] == "paged_mqa_schedule" and "decode" in schedule["modes"]
    assert "torch" in schedule["providers"] and schedule["chosen"] in schedule["available"]


def test_backends_table_names_every_plan_and_full_names_when_piped(capsys):
    out = _run(capsys, "backends")
    for backend, classes in all_plan_classes().items():
        for cls in classes:
            if backend.startswith("test-"):
                continue  # other tests' throwaway schemas, some built once per process
            if any(spec.op for spec in cls.tensor_specs.values()):
                modes = [m.value for m in sorted(cls.modes, key=list(ForwardMode).index)]
                assert f"{backend}: {cls.__name__} (modes: {', '.join(modes)})" in out
    assert "flashinfer_decode" in out and "flashinfer_mla" in out
    assert "paged_mqa_schedule" in out and "…" not in out


def test_backends_on_a_narrow_terminal_fold_names_rather_than_cut_them(capsys, monkeypatch):
    """A 50-column terminal: names wrap onto the next line, no ellipsis replaces them."""
    narrow = lambda out: Console(file=out, width=50, highlight=False, markup=False)  # noqa: E731
    monkeypatch.setattr(backends_command, "_console", narrow)
    out = _run(capsys, "backends")
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 50


def test_ops_lists_the_shared_ops_with_providers_and_users(capsys):
    rows = {r["op"]: r for r in json.loads(_run(capsys, "ops", "--json"))}
    for shared in ("cumsum_with_zero", "gather_token_slots", "page_table", "causal_lengths"):
        assert rows[shared]["package"] == "backends.common", shared
        assert "torch" in rows[shared]["providers"] and "torch" in rows[shared]["available"]
    cumsum = rows["cumsum_with_zero"]
    assert cumsum["description"]
    assert "decode" in cumsum["used_by"]["paged"] and "extend" in cumsum["used_by"]["nsa"]
    assert rows["paged_mqa_schedule"]["used_by"]["nsa"][0] == "decode"
    # every op a registered plan names is listed, with that backend among its users
    for backend, classes in all_plan_classes().items():
        for cls in classes:
            for spec in cls.tensor_specs.values():
                if spec.op:
                    assert backend in rows[spec.op]["used_by"], (backend, spec.op)


def test_ops_text_shows_each_op_whole_when_piped(capsys):
    out = _run(capsys, "ops")
    lines = out.splitlines()
    rows = json.loads(_run(capsys, "ops", "--json"))
    for row in rows:
        assert f"{row['op']}  ({row['package']})" in lines
        assert f"  {row['description']}" in lines  # one line, not wrapped at 80 columns
    assert "…" not in out


def test_configs_are_found_in_a_wheel_and_in_a_checkout(tmp_path):
    """A wheel's package data comes first; a checkout reads its top-level ``configs/``, also
    when an older checkout left an empty ``dsv32_engine/configs`` folder behind."""
    from dsv32_engine import SHIPPED_CONFIGS, configs_folder

    assert (SHIPPED_CONFIGS / "dsv32-tiny.yaml").is_file()
    package = tmp_path / "dsv32_engine"
    (package / "configs").mkdir(parents=True)
    assert configs_folder(package) == tmp_path / "configs"  # empty: a leftover, not data
    (package / "configs" / "dsv32-tiny.yaml").write_text("{}\n")
    assert configs_folder(package) == package / "configs"
