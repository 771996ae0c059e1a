"""Plan dumps: bit-exact round trips, safe replacement, and what loading refuses.

The commands that read dumps (``python -m planner inspect/diff``) and the corrupt dumps
they report are in ``tests/serving/test_dump_commands.py``; the dump ring and the
mismatch hook in ``tests/serving/test_dump_ring.py``.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import (
    DumpError,
    ForwardMode,
    Plan,
    PlanSet,
    Tensor,
    scalar_field,
    tensor_field,
)
from planner.dumps import INDEX, dump_plans, load_dump
from planner.dumps import write as dumps_write
from planner.registry import get_backend
from tests.support.dumps import DUMPS, assert_same_bits

# ---- round trips -------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), next_n=st.integers(1, 3), verify=st.booleans())
def test_paged_plans_round_trip_bit_for_bit(seed, next_n, verify):
    rng = random.Random(seed)
    planner = DUMPS.planner(next_n=next_n)
    mode = ForwardMode.TARGET_VERIFY if verify and next_n > 1 else ForwardMode.DECODE
    batch = DUMPS.batch(rng, next_n=next_n, mode=mode)
    bs = min(s for s in (1, 2, 4, 8, DUMPS.max_batch) if s >= batch.bs)
    planner.capture(bs, mode, req_to_token=DUMPS.table)
    replayed = planner.replay(batch, bs)
    planner.record(bs, mode)
    with tempfile.TemporaryDirectory() as tmp:
        for label, plans in (("eager", planner.plan(batch)), ("replayed", replayed)):
            path = dump_plans(plans, Path(tmp) / label, step=seed % 1000, batch=batch, label=label)
            loaded = load_dump(path)
            assert_same_bits(plans, loaded)
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
        assert_same_bits(plans, loaded)
        for name, tensor in plan.tensors().items():
            summary = loaded.manifests["mixed"].fields[name].summary
            assert summary.count == tensor.numel()
            if tensor.is_floating_point():
                assert summary.nan == int(torch.isnan(tensor.double()).sum())
        # strict JSON on disk: non-finite floats are strings, never NaN literals
        text = (Path(tmp) / "d" / "mixed.json").read_text()
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_dump_replaces_an_old_dump_and_leaves_no_temporaries(tmp_path):
    planner = DUMPS.planner()
    batch = DUMPS.batch(random.Random(1))
    plans = planner.plan(batch)
    dump_plans(plans, tmp_path / "d", step=1)
    dump_plans(plans, tmp_path / "d", step=2)
    assert load_dump(tmp_path / "d").step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_dump_refuses_to_replace_a_directory_that_is_not_a_dump(tmp_path):
    plans = DUMPS.planner().plan(DUMPS.batch(random.Random(1), max_batch=4))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(DumpError, match="not a plan dump"):
        dump_plans(plans, tmp_path / "d")
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    plans = DUMPS.planner().plan(DUMPS.batch(random.Random(1), max_batch=4))
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


# ---- what loading refuses ----------------------------------------------------------------------


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
    assert_same_bits(plans, loaded)


def test_index_cannot_point_outside_the_dump(one_dump):
    path, _ = one_dump
    index = json.loads((path / INDEX).read_text())
    index["backends"]["paged"]["tensors"] = "../../etc/passwd"
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(DumpError, match="unsafe file"):
        load_dump(path)


def test_a_mismatch_directory_is_named_as_such(tmp_path):
    plans = DUMPS.planner().plan(DUMPS.batch(random.Random(1), max_batch=4))
    dump_plans(plans, tmp_path / "mismatch-0" / "replayed")
    with pytest.raises(DumpError, match="holds a mismatch"):
        load_dump(tmp_path / "mismatch-0")
