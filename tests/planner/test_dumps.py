"""Plan dumps: bit-exact round trips, stale fields found by diff, clear errors on bad dumps."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import (
    ConfigError,
    DumpError,
    ForwardMode,
    Limits,
    Plan,
    Planner,
    PlanSet,
    ReplayError,
    Tensor,
    scalar_field,
    tensor_field,
)
from planner.compare import tensor_digest
from planner.dumps import INDEX, dump_plans, load_dump
from planner.dumps import write as dumps_write
from planner.ops import get_op
from planner.registry import get_backend
from serving.cli import build_parser, dispatch
from serving.dump_ring import DumpRing, install_mismatch_dumps
from tests.support import REPO
from tests.support.batches import make_pool, random_batch

PAGE, MAX_CTX, MAX_BATCH = 16, 200, 12
TABLE = make_pool(40, MAX_CTX, PAGE, seed=5)


def _planner(next_n: int = 1, **kwargs) -> Planner:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CTX, page_size=PAGE, next_n=next_n)
    return Planner(["paged"], limits, **kwargs)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same_bits(plans: PlanSet, loaded) -> None:
    """Every tensor field bit for bit (NaN payloads and -0.0 included), every scalar, every pointer."""
    assert loaded.backends == list(plans)
    for backend, plan in plans.items():
        manifest = loaded.manifests[backend]
        for name, tensor in plan.tensors().items():
            got = loaded.tensors[backend][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert _bits(got) == _bits(tensor), name
            record = manifest.fields[name]
            assert record.checksum == tensor_digest(tensor)
            assert record.data_ptr == tensor.data_ptr()
            assert record.device == str(tensor.device)
        assert loaded.scalars(backend) == plan.scalars()


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = dispatch(build_parser().parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- round trips -------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), next_n=st.integers(1, 3), verify=st.booleans())
def test_paged_plans_round_trip_bit_for_bit(seed, next_n, verify):
    rng = random.Random(seed)
    planner = _planner(next_n)
    mode = ForwardMode.TARGET_VERIFY if verify and next_n > 1 else ForwardMode.DECODE
    batch = random_batch(
        rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, next_n=next_n, mode=mode
    )
    bs = min(s for s in (1, 2, 4, 8, MAX_BATCH) if s >= batch.bs)
    planner.capture(bs, mode, req_to_token=TABLE)
    replayed = planner.replay(batch, bs)
    planner.record(bs, mode)
    with tempfile.TemporaryDirectory() as tmp:
        for label, plans in (("eager", planner.plan(batch)), ("replayed", replayed)):
            path = dump_plans(plans, Path(tmp) / label, step=seed % 1000, batch=batch, label=label)
            loaded = load_dump(path)
            _assert_same_bits(plans, loaded)
            assert loaded.step == seed % 1000 and loaded.label == label
            assert loaded.phase == plans.phase and loaded.mode == mode.value
            signature = loaded.batch
            assert signature.bs == batch.bs and signature.padded_reqs == plans.reqs
            assert signature.next_n == batch.next_n
            assert signature.seq_lens.max == int(batch.seq_lens_cpu.max())
            assert signature.seq_lens.sum == int(batch.seq_lens_cpu.sum())
            manifest = loaded.manifests["paged"]
            assert manifest.plan_schema.name == "PagedPlan"
            assert manifest.plan_schema.version == get_backend("paged").version
            record = manifest.fields["token_slots"]
            assert record.spec == get_backend("paged").tensor_specs["token_slots"].to_json()
            slots = plans["paged"].token_slots
            assert record.summary.max == int(slots.max()) and record.summary.sum == int(slots.sum())
            assert record.summary.nonzero == int(torch.count_nonzero(slots))
            assert record.head == slots.reshape(-1)[:8].tolist()


class MixedPlan(Plan):
    """Float and integer fields of every width a dump must carry (not registered as a backend)."""

    f32: Tensor = tensor_field(torch.float32, ("rows",), op="none", pad=0.0)
    bf16: Tensor = tensor_field(torch.bfloat16, ("rows", 3), op="none", pad=0.0)
    f16: Tensor = tensor_field(torch.float16, ("rows",), op="none", pad=0.0)
    f64: Tensor = tensor_field(torch.float64, ("rows",), op="none", pad=0.0)
    i64: Tensor = tensor_field(torch.int64, ("rows", 2), op="none", pad=0)
    u8: Tensor = tensor_field(torch.uint8, ("rows",), op="none", pad=0)
    flag: Tensor = tensor_field(torch.bool, ("rows",), op="none", pad=0)
    width: int = scalar_field("rows")


def _raw(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of arbitrary bit patterns: NaN payloads, infinities, -0.0, denormals."""
    size = torch.empty((), dtype=dtype).element_size()
    need = size * max(1, int(torch.tensor(shape).prod()))
    buf = bytearray((data * (need // max(1, len(data)) + 1))[:need] if data else bytes(need))
    return (
        torch.frombuffer(buf, dtype=torch.uint8)
        .view(dtype)[: int(torch.tensor(shape).prod())]
        .reshape(shape)
        .clone()
    )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 6), data=st.binary(min_size=0, max_size=256), width=st.integers(0, 10**12)
)
def test_float_and_int_fields_round_trip_bit_for_bit(rows, data, width):
    flags = torch.tensor(
        [b % 2 == 1 for b in data[:rows]] + [False] * (rows - len(data[:rows])), dtype=torch.bool
    )
    plan = MixedPlan(
        f32=_raw(data, torch.float32, (rows,)),
        bf16=_raw(data[::-1], torch.bfloat16, (rows, 3)),
        f16=_raw(data[1:], torch.float16, (rows,)),
        f64=_raw(data[2:], torch.float64, (rows,)),
        i64=_raw(data[3:], torch.int64, (rows, 2)),
        u8=_raw(data, torch.uint8, (rows,)),
        flag=flags,
        width=width,
    )
    plans = PlanSet({"mixed": plan}, "eager", ForwardMode.DECODE, rows, rows)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_dump(dump_plans(plans, Path(tmp) / "d"))
        _assert_same_bits(plans, loaded)
        for name, tensor in plan.tensors().items():
            summary = loaded.manifests["mixed"].fields[name].summary
            assert summary.count == tensor.numel()
            if tensor.is_floating_point():
                assert summary.nan == int(torch.isnan(tensor.double()).sum())
        # strict JSON on disk: non-finite floats are strings, never NaN literals
        text = (Path(tmp) / "d" / "mixed.json").read_text()
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_dump_replaces_an_old_dump_and_leaves_no_temporaries(tmp_path):
    planner = _planner()
    batch = random_batch(random.Random(1), TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX)
    plans = planner.plan(batch)
    dump_plans(plans, tmp_path / "d", step=1)
    dump_plans(plans, tmp_path / "d", step=2)
    assert load_dump(tmp_path / "d").step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_dump_refuses_to_replace_a_directory_that_is_not_a_dump(tmp_path):
    plans = _planner().plan(random_batch(random.Random(1), TABLE, max_batch=4, max_context=MAX_CTX))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(DumpError, match="not a plan dump"):
        dump_plans(plans, tmp_path / "d")
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    plans = _planner().plan(random_batch(random.Random(1), TABLE, max_batch=4, max_context=MAX_CTX))
    real = dumps_write.write_synced
    calls = []

    def flaky(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(dumps_write, "write_synced", flaky)
    with pytest.raises(DumpError, match="No space left on device"):
        dump_plans(plans, tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


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
    planner = _planner(debug=True)
    dumper = install_mismatch_dumps(planner, tmp_path / "dumps")
    rng = random.Random(11)
    planner.capture(8, req_to_token=TABLE)
    first = random_batch(rng, TABLE, max_batch=8, max_context=MAX_CTX, bs=6)
    plans = planner.replay(first, 8)
    planner.record(8)
    planner.verify(first, plans)  # a healthy replay writes nothing
    assert dumper.paths == []

    second = random_batch(rng, TABLE, max_batch=8, max_context=MAX_CTX, bs=5)
    stale_page_table["skip"] = True
    plans = planner.replay(second, 8)
    planner.record(8)
    stale_page_table["skip"] = False
    with (
        caplog.at_level(logging.WARNING, logger="serving.dump_ring"),
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
    planner = _planner(debug=True)
    dumper = install_mismatch_dumps(planner, tmp_path)
    planner.capture(4, req_to_token=TABLE)
    batch = random_batch(random.Random(3), TABLE, max_batch=4, max_context=MAX_CTX, bs=3)
    plans = planner.replay(batch, 4)  # the graph never replayed: in-graph ops did not run
    with pytest.raises(ReplayError):
        planner.verify(batch, plans)
    from serving.commands.diff import diff_dumps

    (where,) = dumper.paths
    diffs = diff_dumps(load_dump(where / "replayed"), load_dump(where / "eager"))
    differing = {d.field for d in diffs if d.differs}
    assert {"token_slots", "page_table"} <= differing
    assert not differing & {"seq_lens", "req_pool_indices", "out_cache_loc"}  # staged: fresh


def test_python_m_planner_diff_and_inspect(tmp_path, capsys):
    """The commands as wired into ``python -m planner`` (one real subprocess: torch imports slowly)."""
    from serving.cli import main

    planner = _planner()
    rng = random.Random(2)
    batches = [random_batch(rng, TABLE, max_batch=4, max_context=MAX_CTX, bs=3) for _ in range(2)]
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


@pytest.fixture
def one_dump(tmp_path) -> tuple[Path, PlanSet]:
    planner = _planner()
    batch = random_batch(random.Random(4), TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=5)
    plans = planner.plan(batch)
    return dump_plans(plans, tmp_path / "d", step=42, batch=batch, label="probe"), plans


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
    planner = _planner()
    batch = random_batch(random.Random(6), TABLE, max_batch=4, max_context=MAX_CTX, bs=2)
    plans = planner.plan(batch)
    a = dump_plans(plans, tmp_path / "a")
    b = dump_plans(plans, tmp_path / "b")
    c = dump_plans(planner.plan(batch), tmp_path / "c")  # same values, fresh tensors
    assert _run(capsys, "diff", str(a), str(b))[0] == 0
    code, out, _ = _run(capsys, "diff", str(a), str(c))
    assert code == 0 and "dumps are equal" in out
    code, out, _ = _run(capsys, "diff", str(a), str(c), "--pointers", "--json")
    assert code == 1 and "paged.page_table" in json.loads(out)["differing"]


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
        assert err.startswith(f"planner {argv[0]}: error: ") and len(err.strip().splitlines()) == 1


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


def _rewrite_member(dump: Path, name: str, text: str) -> None:
    """Change a member and fix its size and hash in the index: a crafted, self-consistent dump."""
    data = text.encode()
    (dump / name).write_bytes(data)
    index = json.loads((dump / INDEX).read_text())
    index["files"][name] = {"bytes": len(data), "blake2b": dumps_write.blake2b(data)}
    (dump / INDEX).write_text(json.dumps(index))


def test_loading_imports_nothing_the_manifest_names(one_dump):
    path, plans = one_dump
    manifest = json.loads((path / "paged.json").read_text())
    manifest["plan_schema"]["module"] = "no_such_module_for_dump_tests"
    _rewrite_member(path, "paged.json", json.dumps(manifest))
    loaded = load_dump(path)
    assert "no_such_module_for_dump_tests" not in sys.modules
    _assert_same_bits(plans, loaded)


def test_index_cannot_point_outside_the_dump(one_dump):
    path, _ = one_dump
    index = json.loads((path / INDEX).read_text())
    index["backends"]["paged"]["tensors"] = "../../etc/passwd"
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(DumpError, match="unsafe file"):
        load_dump(path)


def test_a_mismatch_directory_is_named_as_such(tmp_path):
    plans = _planner().plan(random_batch(random.Random(1), TABLE, max_batch=4, max_context=MAX_CTX))
    dump_plans(plans, tmp_path / "mismatch-0" / "replayed")
    with pytest.raises(DumpError, match="holds a mismatch"):
        load_dump(tmp_path / "mismatch-0")


# ---- ring buffer and environment ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small_plans() -> tuple[PlanSet, object]:
    batch = random_batch(random.Random(8), TABLE, max_batch=4, max_context=MAX_CTX, bs=2)
    return _planner().plan(batch), batch


def _steps_on_disk(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step-"))


def test_ring_keeps_the_last_n(tmp_path, small_plans):
    plans, batch = small_plans
    ring = DumpRing(tmp_path, keep_last=3)
    for step in range(10):
        assert ring.maybe_dump(step, plans, batch) == tmp_path / f"step-{step:06d}"
    assert _steps_on_disk(tmp_path) == ["step-000007", "step-000008", "step-000009"]
    assert ring.kept == [tmp_path / f"step-00000{s}" for s in (7, 8, 9)]
    assert load_dump(tmp_path / "step-000009").step == 9


def test_ring_every_and_step_filter(tmp_path, small_plans):
    plans, batch = small_plans
    ring = DumpRing(tmp_path / "every", every=3, keep_last=10)
    written = [s for s in range(10) if ring.maybe_dump(s, plans, batch)]
    assert written == [0, 3, 6, 9]
    ring = DumpRing(tmp_path / "range", steps=range(4, 6), keep_last=10)
    assert [s for s in range(10) if ring.maybe_dump(s, plans, batch)] == [4, 5]
    ring = DumpRing(tmp_path / "both", every=2, steps={3, 4, 7, 8}, keep_last=10)
    assert [s for s in range(10) if ring.maybe_dump(s, plans, batch)] == [4, 8]


def test_ring_adopts_an_earlier_run_and_touches_nothing_else(tmp_path, small_plans):
    plans, batch = small_plans
    first = DumpRing(tmp_path, keep_last=2)
    for step in (500, 501):
        first.maybe_dump(step, plans, batch)
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "step-abc").mkdir()
    second = DumpRing(tmp_path, keep_last=2)  # a restarted loop, counting from 0 again
    second.maybe_dump(0, plans, batch)
    assert _steps_on_disk(tmp_path) == ["step-000000", "step-000501", "step-abc"]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_ring_logs_a_failed_dump_and_goes_on(tmp_path, small_plans, caplog):
    plans, batch = small_plans
    (tmp_path / "file").write_text("not a directory")
    ring = DumpRing(tmp_path / "file" / "dumps", keep_last=2)
    with caplog.at_level(logging.ERROR, logger="serving.dump_ring"):
        assert ring.maybe_dump(0, plans, batch) is None
    assert ring.failures == 1 and "step 0 failed" in caplog.text


def test_ring_from_env(tmp_path):
    assert DumpRing.from_env({}) is None
    assert DumpRing.from_env({"PLANNER_DUMP_DIR": "  "}) is None
    ring = DumpRing.from_env(
        {"PLANNER_DUMP_DIR": str(tmp_path), "PLANNER_DUMP_EVERY": "5", "PLANNER_DUMP_KEEP": "3"}
    )
    assert (ring.directory, ring.every, ring.keep_last) == (tmp_path, 5, 3)
    defaults = DumpRing.from_env({"PLANNER_DUMP_DIR": str(tmp_path)})
    assert (defaults.every, defaults.keep_last) == (1, 8)


@pytest.mark.parametrize(
    "name,value",
    [
        ("PLANNER_DUMP_EVERY", "abc"),
        ("PLANNER_DUMP_EVERY", "0"),
        ("PLANNER_DUMP_KEEP", "-2"),
        ("PLANNER_DUMP_KEEP", "2.5"),
    ],
)
def test_ring_from_env_rejects_bad_values(tmp_path, name, value):
    with pytest.raises(ConfigError, match=rf"\[{name}\] must be a positive integer") as info:
        DumpRing.from_env({"PLANNER_DUMP_DIR": str(tmp_path), name: value})
    assert value in str(info.value)


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"keep_last": 0}, {"every": True}])
def test_ring_rejects_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ConfigError, match="positive integer"):
        DumpRing(tmp_path, **kwargs)


# ---- mismatch hook -----------------------------------------------------------------------------


def test_mismatch_dumps_count_up_and_chain(tmp_path, small_plans):
    plans, batch = small_plans
    planner = _planner()
    seen = []
    planner.on_mismatch = lambda *args: seen.append(args)
    (tmp_path / "mismatch-5").mkdir()
    dumper = install_mismatch_dumps(planner, tmp_path)
    planner.on_mismatch(batch, plans, plans)
    planner.on_mismatch(batch, plans, plans)
    assert dumper.paths == [tmp_path / "mismatch-6", tmp_path / "mismatch-7"]
    assert len(seen) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failing_mismatch_dump_never_hides_the_replay_error(tmp_path, caplog):
    planner = _planner(debug=True)
    (tmp_path / "file").write_text("x")
    dumper = install_mismatch_dumps(planner, tmp_path / "file" / "sub")
    planner.capture(4, req_to_token=TABLE)
    batch = random_batch(random.Random(9), TABLE, max_batch=4, max_context=MAX_CTX, bs=4)
    plans = planner.replay(batch, 4)  # no record(): stale
    with caplog.at_level(logging.ERROR, logger="serving.dump_ring"), pytest.raises(ReplayError):
        planner.verify(batch, plans)
    assert dumper.paths == [] and "could not dump" in caplog.text


def test_diff_reports_shape_changes_and_missing_fields(tmp_path, capsys):
    planner = _planner()
    rng = random.Random(12)
    small = planner.plan(random_batch(rng, TABLE, max_batch=4, max_context=MAX_CTX, bs=2))
    large = planner.plan(random_batch(rng, TABLE, max_batch=4, max_context=MAX_CTX, bs=3))
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
