"""The dump ring (``PLANNER_DUMP_*``: the last N steps' plans on disk) and the mismatch hook
that dumps both sides of a failed replay check."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from dsv32_engine.serving.dump_ring import DumpRing, install_mismatch_dumps
from planner import ConfigError, PlanSet, ReplayError
from planner.dumps import load_dump
from tests.support.dumps import DUMPS

# ---- ring buffer and environment ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small_plans() -> tuple[PlanSet, object]:
    batch = DUMPS.batch(random.Random(8), bs=2)
    return DUMPS.planner().plan(batch), batch


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
    with caplog.at_level(logging.ERROR, logger="dsv32_engine.serving.dump_ring"):
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
    planner = DUMPS.planner()
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
    planner = DUMPS.planner(debug=True)
    (tmp_path / "file").write_text("x")
    dumper = install_mismatch_dumps(planner, tmp_path / "file" / "sub")
    planner.capture(4, req_to_token=DUMPS.table)
    batch = DUMPS.batch(random.Random(9), bs=4)
    plans = planner.replay(batch, 4)  # no record(): stale
    with (
        caplog.at_level(logging.ERROR, logger="dsv32_engine.serving.dump_ring"),
        pytest.raises(ReplayError),
    ):
        planner.verify(batch, plans)
    assert dumper.paths == [] and "could not dump" in caplog.text
