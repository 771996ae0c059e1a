"""The commands that read plan dumps: a stale field found by diff, inspect, and the clear
one-line errors ``python -m planner inspect/diff`` give on corrupt or missing dumps."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv32_engine.serving.cli import ERROR_PREFIX, build_parser, dispatch
from dsv32_engine.serving.dump_ring import install_mismatch_dumps
from planner import DumpError, ForwardMode, PlanError, PlanSet, ReplayError
from planner.debug import tensor_digest
from planner.dumps import (
    INDEX,
    diff_dumps,
    diff_report,
    dump_plans,
    inspect_report,
    load_dump,
    print_diff,
    print_dump,
)
from planner.ops import get_op
from planner.registry import get_backend
from tests.support import REPO
from tests.support.dumps import DUMPS


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = dispatch(build_parser().parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- a stale field: caught, dumped, diffed -----------------------------------------------------


@pytest.fixture
def stale_page_table(monkeypatch):
    """A page_table provider that can be told to do nothing: one refresh skipped on replay."""
    get_backend("paged")  # registers the generic ops
    op = get_op("page_table")
    original = op.providers["torch"]
    state = {"skip": False}

    def maybe(out, *inputs, **params):
        if not state["skip"]:
            original.fn(out, *inputs, **params)

    monkeypatch.setitem(op.providers, "torch", dataclasses.replace(original, fn=maybe))
    return state


def test_stale_field_is_dumped_on_mismatch_and_diff_points_at_rows(
    tmp_path, stale_page_table, capsys, caplog
):
    planner = DUMPS.planner(debug=True)
    dumper = install_mismatch_dumps(planner, tmp_path / "dumps")
    rng = random.Random(11)
    planner.capture(8, req_to_token=DUMPS.table)
    first = DUMPS.batch(rng, bs=6)
    plans = planner.replay(first, 8)
    planner.record(8)
    planner.verify(first, plans)  # a healthy replay writes nothing
    assert dumper.paths == []

    second = DUMPS.batch(rng, bs=5)
    stale_page_table["skip"] = True
    plans = planner.replay(second, 8)
    planner.record(8)
    stale_page_table["skip"] = False
    with (
        caplog.at_level(logging.WARNING, logger="dsv32_engine.serving.dump_ring"),
        pytest.raises(ReplayError) as info,
    ):
        planner.verify(second, plans)
    assert info.value.field == "paged.page_table"

    (where,) = dumper.paths
    assert where == tmp_path / "dumps" / "mismatch-0"
    assert str(where) in caplog.text
    note = json.loads((where / "mismatch.json").read_text())
    assert len(note["mismatches"]) == 1 and note["mismatches"][0].startswith("paged.page_table")
    replayed, eager = load_dump(where / "replayed"), load_dump(where / "eager")
    assert replayed.label == "replayed" and eager.phase == "eager"
    assert replayed.batch.bs == 5 and replayed.batch.padded_reqs == 8

    fresh = planner.plan(second, pad_to=8)["paged"].page_table
    stale = plans["paged"].page_table
    assert torch.equal(eager.tensors["paged"]["page_table"], fresh)
    assert torch.equal(replayed.tensors["paged"]["page_table"], stale)
    rows = (fresh != stale).any(dim=1).nonzero().flatten().tolist()
    assert rows  # the test is only meaningful if the stale rows differ

    code, out, _ = _run(capsys, "diff", str(where / "replayed"), str(where / "eager"), "--json")
    assert code == 1
    report = json.loads(out)
    assert report["differing"] == ["paged.page_table"]
    (entry,) = [f for f in report["fields"] if f["field"] == "page_table"]
    assert entry["rows"] == rows and entry["count"] == int((fresh != stale).sum())
    for element in entry["elements"]:
        r, c = element["index"]
        assert element["a"] == int(stale[r, c]) and element["b"] == int(fresh[r, c])

    code, out, _ = _run(capsys, "diff", str(where))  # one argument: the mismatch directory
    assert code == 1
    assert "page_table" in out and "rows " + ", ".join(map(str, rows)) in out
    assert "1 field(s) differ: paged.page_table" in out


def test_replay_without_record_leaves_in_graph_fields_stale(tmp_path):
    """The graph writes every field: the source fields too (the device check, recorded in the
    graph, writes them from the raw inputs). A replay whose graph never ran leaves them all as
    the capture left them; only the raw inputs reached the device."""
    planner = DUMPS.planner(debug=True)
    dumper = install_mismatch_dumps(planner, tmp_path)
    captured = planner.capture(4, req_to_token=DUMPS.table)
    sources = ("seq_lens", "req_pool_indices", "out_cache_loc")
    at_capture = {name: captured["paged"].tensors()[name].clone() for name in sources}
    batch = DUMPS.batch(random.Random(3), bs=3)
    plans = planner.replay(batch, 4)  # the graph never replayed: in-graph ops did not run
    with pytest.raises(ReplayError):
        planner.verify(batch, plans)

    (where,) = dumper.paths
    replayed = load_dump(where / "replayed")
    diffs = diff_dumps(replayed, load_dump(where / "eager"))
    differing = {d.field for d in diffs if d.differs}
    assert {"token_slots", "page_table", *sources} <= differing
    for name in sources:  # stale: the capture's dummy batch, not the replayed one
        assert torch.equal(replayed.tensors["paged"][name], at_capture[name]), name
    stager = planner._captured[(ForwardMode.DECODE, 4)].stager
    at = stager.layout.offsets["seq_lens"]  # the raw inputs were sent: the replayed batch's
    assert stager.device_buf[at : at + 3].tolist() == batch.seq_lens_cpu.tolist()


def test_python_m_planner_diff_and_inspect(tmp_path, capsys):
    """The commands as wired into ``python -m planner`` (one real subprocess: torch imports slowly)."""
    from dsv32_engine.serving.cli import main

    planner = DUMPS.planner()
    rng = random.Random(2)
    batches = [DUMPS.batch(rng, bs=3) for _ in range(2)]
    a = dump_plans(planner.plan(batches[0]), tmp_path / "a")
    b = dump_plans(planner.plan(batches[1]), tmp_path / "b")
    diff = subprocess.run(
        [sys.executable, "-m", "planner", "diff", str(a), str(b), "--json"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert diff.returncode == 1, diff.stderr
    assert "paged.seq_lens" in json.loads(diff.stdout)["differing"]
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["inspect", str(a)]) == 0 and "token_slots" in capsys.readouterr().out
    (tmp_path / "a" / "paged.json").write_text("{")
    assert main(["inspect", str(a)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "paged.json" in err


# ---- inspect -----------------------------------------------------------------------------------


def test_inspect_renders_every_field(one_dump, capsys):
    path, plans = one_dump
    code, out, err = _run(capsys, "inspect", str(path))
    assert code == 0 and err == ""
    plan = plans["paged"]
    for key in (
        "PagedPlan v1",
        "step 42",
        "'probe'",
        "phase eager",
        "mode decode",
        "bs 5",
        "max_seq_len=",
    ):
        assert key in out, key
    for name, tensor in plan.tensors().items():
        assert name in out
        assert hex(tensor.data_ptr()) in out
        assert tensor_digest(tensor)[:12] in out
    assert "int32" in out and "cpu" in out


def test_inspect_one_field_in_full(one_dump, capsys):
    path, plans = one_dump
    table = plans["paged"].page_table
    code, out, _ = _run(capsys, "inspect", str(path), "--field", "paged.page_table", "--full")
    assert code == 0
    assert tensor_digest(table) in out  # the whole checksum when one field is shown
    assert "kv_lens" not in out
    assert f"[{table.shape[0] - 1}] {table[-1].tolist()}" in out


def test_inspect_json(one_dump, capsys):
    path, plans = one_dump
    code, out, _ = _run(capsys, "inspect", str(path), "--json", "--full", "--field", "token_slots")
    assert code == 0
    report = json.loads(out)
    fields = report["backends"]["paged"]["fields"]
    assert list(fields) == ["token_slots"]
    assert fields["token_slots"]["values"] == plans["paged"].token_slots.tolist()
    assert report["index"]["step"] == 42


def test_inspect_unknown_field_is_an_error(one_dump, capsys):
    path, _ = one_dump
    code, out, err = _run(capsys, "inspect", str(path), "--field", "nope")
    assert code == 2 and out == ""
    assert "no field 'nope'" in err and "paged.page_table" in err
    assert len(err.strip().splitlines()) == 1


def test_diff_of_equal_dumps_and_pointer_option(tmp_path, capsys):
    planner = DUMPS.planner()
    batch = DUMPS.batch(random.Random(6), bs=2)
    plans = planner.plan(batch)
    a = dump_plans(plans, tmp_path / "a")
    b = dump_plans(plans, tmp_path / "b")
    c = dump_plans(planner.plan(batch), tmp_path / "c")  # same values, fresh tensors
    assert _run(capsys, "diff", str(a), str(b))[0] == 0
    code, out, _ = _run(capsys, "diff", str(a), str(c))
    assert code == 0 and "dumps are equal" in out
    code, out, _ = _run(capsys, "diff", str(a), str(c), "--pointers", "--json")
    assert code == 1 and "paged.page_table" in json.loads(out)["differing"]


def test_diff_reports_shape_changes_and_missing_fields(tmp_path, capsys):
    planner = DUMPS.planner()
    rng = random.Random(12)
    small = planner.plan(DUMPS.batch(rng, bs=2))
    large = planner.plan(DUMPS.batch(rng, bs=3))
    a, b = dump_plans(small, tmp_path / "a"), dump_plans(large, tmp_path / "b")
    code, out, _ = _run(capsys, "diff", str(a), str(b), "--json")
    assert code == 1
    fields = {f["field"]: f for f in json.loads(out)["fields"]}
    assert fields["seq_lens"]["reason"] == "shape (2,) != (3,)"
    assert fields["seq_lens"]["shape_a"] == [2] and fields["seq_lens"]["shape_b"] == [3]
    mixed = PlanSet({"other": small["paged"]}, "eager", ForwardMode.DECODE, 2, 2)
    c = dump_plans(mixed, tmp_path / "c")
    code, out, _ = _run(capsys, "diff", str(a), str(c), "--json")
    statuses = {(f["backend"], f["status"]) for f in json.loads(out)["fields"]}
    assert code == 1 and statuses == {("paged", "only in A"), ("other", "only in B")}


# ---- the library the commands wrap -------------------------------------------------------------


def test_the_library_prints_what_inspect_prints(one_dump, capsys):
    """``planner.dumps`` alone shows a dump as the command does: the same text, the same JSON."""
    path, _ = one_dump
    for argv, kwargs in (
        ((), {}),
        (("--field", "page_table", "--full"), {"field": "page_table", "full": True}),
    ):
        code, out, _ = _run(capsys, "inspect", str(path), *argv)
        text = io.StringIO()
        print_dump(path, file=text, **kwargs)  # a path: loaded and checked first
        assert code == 0 and text.getvalue() == out
    code, out, _ = _run(capsys, "inspect", str(path), "--json", "--field", "max_seq_len")
    assert code == 0 and json.loads(out) == inspect_report(load_dump(path), "max_seq_len")
    with pytest.raises(PlanError, match="no field 'nope' .*paged.page_table"):
        inspect_report(load_dump(path), "nope")


def test_the_library_prints_what_diff_prints(tmp_path, capsys):
    planner = DUMPS.planner()
    rng = random.Random(8)
    a = dump_plans(planner.plan(DUMPS.batch(rng, bs=3)), tmp_path / "a")
    b = dump_plans(planner.plan(DUMPS.batch(rng, bs=3)), tmp_path / "b")
    text = io.StringIO()
    assert print_diff(a, load_dump(a), file=text) == []  # paths or loaded dumps
    assert text.getvalue().endswith("dumps are equal\n")
    code, out, _ = _run(capsys, "diff", str(a), str(b))
    text = io.StringIO()
    differs = print_diff(a, b, file=text)
    assert code == 1 and text.getvalue() == out
    assert {f"{d.backend}.{d.field}" for d in differs} >= {"paged.seq_lens"}
    code, out, _ = _run(capsys, "diff", str(a), str(b), "--json")
    loaded = load_dump(a), load_dump(b)
    assert json.loads(out) == diff_report(*loaded, diff_dumps(*loaded))


# ---- corrupt, truncated, missing ---------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _data_offset(path: Path) -> int:
    """Where a safetensors file's tensor bytes start (after its 8-byte length and JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _corruptions():
    def bad_index_json(d):
        (d / INDEX).write_text("{not json")

    def bad_manifest_json(d):
        p = d / "paged.json"
        p.write_bytes(b"X" + p.read_bytes()[1:])  # same size: reaches the JSON parser

    def truncated_manifest(d):
        p = d / "paged.json"
        p.write_bytes(p.read_bytes()[:-40])

    def flipped_tensor_byte(d):
        p = d / "paged.safetensors"
        _flip(p, _data_offset(p) + 5)

    def flipped_header_byte(d):
        _flip(d / "paged.safetensors", 8)

    def truncated_tensors(d):
        p = d / "paged.safetensors"
        p.write_bytes(p.read_bytes()[:-10])

    def missing_tensors(d):
        (d / "paged.safetensors").unlink()

    def wrong_schema_in_manifest(d):
        p = d / "paged.json"
        text = p.read_text().replace('"fields": {', '"fields": [', 1)
        p.write_text(text + " " * (len(p.read_bytes()) - len(text.encode())))

    return {
        "bad index JSON": (bad_index_json, "dump.json is not valid JSON"),
        "bad manifest JSON": (bad_manifest_json, "paged.json is not valid JSON"),
        "truncated manifest": (truncated_manifest, "truncated plan dump: .*paged.json has"),
        "flipped tensor byte": (
            flipped_tensor_byte,
            "checksum mismatch for field .* in .*paged.safetensors",
        ),
        "flipped header byte": (flipped_header_byte, "paged.safetensors"),
        "truncated tensors": (truncated_tensors, "truncated plan dump: .*paged.safetensors has"),
        "missing tensors": (missing_tensors, "missing .*paged.safetensors"),
        "manifest fails validation": (wrong_schema_in_manifest, "paged.json"),
    }


@pytest.mark.parametrize("case", list(_corruptions()))
def test_corrupt_dumps_raise_dump_error_naming_the_file(one_dump, case, capsys):
    path, _ = one_dump
    corrupt, message = _corruptions()[case]
    corrupt(path)
    with pytest.raises(DumpError, match=message) as info:
        load_dump(path)
    assert "\n" not in str(info.value)
    for argv in (("inspect", str(path)), ("diff", str(path), str(path))):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == ""
        assert err.startswith(f"{ERROR_PREFIX} {argv[0]}: ") and len(err.strip().splitlines()) == 1


def test_missing_and_foreign_paths(tmp_path, capsys):
    with pytest.raises(DumpError, match="does not exist"):
        load_dump(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DumpError, match="not a directory"):
        load_dump(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="dump.json is missing"):
        load_dump(tmp_path / "empty")
    code, _, err = _run(capsys, "diff", str(tmp_path / "empty"))
    assert code == 2 and "two dumps" in err
