"""What a decode run writes: its own dump folder per run, said where, listed by inspect; the
JSON with the tokens. (The refusals of bad paths are in test_cli_catalogue.py.)"""

from __future__ import annotations

import json
import random

from dsv32_engine.serving.cli import main
from dsv32_engine.serving.dump_ring import MismatchDumper
from tests.support.dumps import DUMPS

RUN = ["decode", "--quiet", "--requests", "3", "--dump-every", "8", "--dump-keep", "2"]


def test_each_run_dumps_into_its_own_folder_and_says_where(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PLANNER_DUMP_DIR", raising=False)
    base = tmp_path / "dumps"
    out = tmp_path / "summary.json"
    assert main([*RUN, "--dump-dir", str(base)]) == 0
    first = capsys.readouterr().out
    assert main([*RUN, "--dump-dir", str(base), "--json", str(out)]) == 0
    second = capsys.readouterr().out
    runs = sorted(p.name for p in base.iterdir())
    assert runs == ["run-0001", "run-0002"]  # the second run deleted nothing of the first
    for name, said in zip(runs, (first, second)):
        steps = sorted(p.name for p in (base / name).iterdir() if p.name.startswith("step-"))
        assert len(steps) == 2, steps  # each its own ring of 2
        assert f"plan dumps: {base / name} (2 step dumps, 0 mismatches)" in said
    data = json.loads(out.read_text())
    assert data["summary"]["dump_dir"] == str(base / "run-0002")
    assert len(data["tokens"]) == data["summary"]["requests_finished"] == 3

    assert main(["inspect", str(base)]) == 0
    listing = capsys.readouterr().out
    assert "2 runs" in listing and "run-0001/  2 dumps" in listing
    assert main(["inspect", str(base / "run-0001")]) == 0
    listing = capsys.readouterr().out
    assert "2 step dumps, 0 mismatches" in listing and "step-000008" in listing
    assert main(["inspect", str(base / "run-0001"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [d["kind"] for d in found["dumps"]] == ["step", "step"]

    step = next((base / "run-0001").glob("step-*"))
    assert main(["inspect", str(step), "--field", "topk"]) == 0
    assert "nsa.topk = 16" in capsys.readouterr().out
    assert main(["inspect", str(step), "--field", "nsa.topk", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backends"]["nsa"]["scalars"] == {"topk": 16}


def test_a_failed_engine_build_leaves_no_empty_run_folder(tmp_path, capsys, monkeypatch):
    base = tmp_path / "dumps"  # (a bad PLANNER_* value is refused before the folder is made)
    assert main([*RUN, "--dump-dir", str(base), "--provider", "page_table=cutlass"]) == 2
    assert "page_table" in capsys.readouterr().err  # refused when the planner is built
    assert list(base.iterdir()) == []


def test_inspect_lists_a_run_folders_mismatches(tmp_path, capsys):
    planner = DUMPS.planner()
    batch = DUMPS.batch(random.Random(1), bs=3)
    plans = planner.plan(batch)
    MismatchDumper(tmp_path / "run-0001" / "mismatches")(batch, plans, plans)
    assert main(["inspect", str(tmp_path / "run-0001")]) == 0
    out = capsys.readouterr().out
    assert "0 step dumps, 1 mismatches" in out and "mismatches/mismatch-0" in out
    assert f"python -m planner diff {tmp_path / 'run-0001'}/mismatches/mismatch-0" in out
