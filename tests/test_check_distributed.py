"""``scripts/gpu_distributed.sh`` and its judge, ``benchmarks/loop/check_distributed.py``, on the CPU.

The script's CPU dry run (``CPU_DRY_RUN=1``: dsv32-tiny, gloo under ``torchrun``, 6
requests) makes real runs of issue 40's steps, ``tp_mtp``, ``ref_mtp`` (TP = 1, one
process) and ``dp_mtp``, and judges them: they pass. Copies of those files, doctored one
way each, must fail, naming the check that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.loop.check_distributed import judge, main
from tests.support import REPO

SCRIPT = REPO / "scripts" / "gpu_distributed.sh"
STEPS = ["tp_mtp", "ref_mtp", "dp_mtp"]
REQUESTS = 6  # the dry run's SPEC_REQUESTS
SPEC_STEPS = 40  # and its SPEC_STEPS


def _script(out: Path, *steps: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OUT": str(out),
        "CPU_DRY_RUN": "1",
        # the script calls python3: this interpreter's, the work tree first on the path
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *steps],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One dry run of the three steps (about 20 s on 2 cores): their files, judged."""
    out = tmp_path_factory.mktemp("dist")
    done = _script(out, *STEPS)
    log = (
        (out / "log_distributed.txt").read_text() if (out / "log_distributed.txt").exists() else ""
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    return out


def _copy(runs: Path, dst: Path) -> Path:
    shutil.copytree(runs, dst / "runs")
    return dst / "runs"


def _judge(folder: Path, *names: str, **kw) -> dict:
    return judge(list(names), [folder], requests=REQUESTS, spec_steps=SPEC_STEPS, **kw)


def _doctor(folder: Path, name: str, change) -> None:
    path = folder / f"dist_{name}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _failed(result: dict) -> list[str]:
    return [k for k, v in result["checks"].items() if not v]


def test_the_dry_run_passes_and_writes_every_run(runs):
    report = json.loads((runs / "distributed.json").read_text())
    assert list(report) == STEPS
    for name in STEPS:
        assert report[name]["ok"], (name, report[name]["checks"])
        assert (runs / f".rc_{name}").read_text().strip() == "0"
        rates = report[name]["tokens_per_second"]
        assert rates["aggregate"] > 0 and all(r > 0 for r in rates["per_rank"])
    assert len(report["tp_mtp"]["tokens_per_second"]["per_rank"]) == 2
    assert len(report["dp_mtp"]["tokens_per_second"]["per_rank"]) == 2
    # the draft's forwards were signature- and digest-checked, every one of them
    total = report["tp_mtp"]["aggregate"]
    assert {"target_verify", "draft_extend", "draft_decode"} <= set(total["checks_by_mode"])
    assert total["digest_checks"] == total["signature_checks"]
    # on the CPU TP = 2 sums float64 partials: the same tokens as one process, every request
    vs = report["tp_mtp"]["vs_tp1"]
    assert vs["compared"] == vs["equal"] == REQUESTS and vs["all_equal"], vs
    shapes = report["dp_mtp"]["aggregate"]["idle_by_shape"]
    assert all({"target_verify", "draft_extend", "draft_decode"} <= set(s) for s in shapes), shapes


def test_tp1_equality_is_reported_and_required_only_when_asked(runs, tmp_path):
    folder = _copy(runs, tmp_path)
    assert main(["tp_mtp", "--out", str(folder), "--requests", "6", "--require-tp1-equal"]) == 0

    def change(data):
        rid = sorted(data["tokens"], key=int)[0]
        data["tokens"][rid][2] += 1

    _doctor(folder, "ref_mtp", change)
    result = _judge(folder, "tp_mtp")["tp_mtp"]
    assert result["ok"] and result["vs_tp1"]["equal"] == REQUESTS - 1
    assert list(result["vs_tp1"]["first_differing_token"].values()) == [2]
    assert main(["tp_mtp", "--out", str(folder), "--requests", "6"]) == 0
    assert main(["tp_mtp", "--out", str(folder), "--requests", "6", "--require-tp1-equal"]) == 1
    report = json.loads((folder / "distributed.json").read_text())
    assert _failed(report["tp_mtp"]) == ["tokens equal to the TP = 1 run"]


def test_a_reference_from_another_call_is_found_with_also(runs, tmp_path):
    here, earlier = tmp_path / "here", tmp_path / "earlier"
    here.mkdir(), earlier.mkdir()
    for name in ("dist_tp_mtp.json", ".rc_tp_mtp"):
        shutil.copy(runs / name, here / name)
    for name in ("dist_ref_mtp.json", ".rc_ref_mtp"):
        shutil.copy(runs / name, earlier / name)
    assert "vs_tp1" not in judge(["tp_mtp"], [here], requests=REQUESTS)["tp_mtp"]
    argv = ["tp_mtp", "ref_mtp", "--out", str(here), "--also", str(earlier), "--requests", "6"]
    assert main(argv) == 0
    report = json.loads((here / "distributed.json").read_text())
    assert report["tp_mtp"]["vs_tp1"]["equal"] == REQUESTS
    assert report["ref_mtp"]["from"] == str(earlier)


def test_a_rank_short_of_a_digest_fails(runs, tmp_path):
    folder = _copy(runs, tmp_path)

    def change(data):  # rank 1 digested one forward less than it signature-checked
        data["aggregate"]["digest_checks"][1] = data["aggregate"]["signature_checks"][1] - 1

    _doctor(folder, "tp_mtp", change)
    result = _judge(folder, "tp_mtp")["tp_mtp"]
    assert not result["ok"]
    assert _failed(result) == ["digest checks == signature checks on every rank"]
    assert main(["tp_mtp", "--out", str(folder), "--requests", "6"]) == 1


def test_a_tp_run_without_draft_checks_fails(runs, tmp_path):
    folder = _copy(runs, tmp_path)

    def change(data):
        for by_mode in [data["aggregate"]["checks_by_mode"]] + [
            r["checks_by_mode"] for r in data["ranks"]
        ]:
            by_mode.pop("draft_decode")

    _doctor(folder, "tp_mtp", change)
    failed = _failed(_judge(folder, "tp_mtp")["tp_mtp"])
    assert failed == [
        "target_verify, draft_extend, draft_decode forwards checked",
        "checks by mode add up to the signature checks",
    ]


def test_idle_batches_without_draft_shapes_fail(runs, tmp_path):
    folder = _copy(runs, tmp_path)

    def change(data):
        data["aggregate"]["idle_by_shape"] = [
            {k: v for k, v in shapes.items() if not k.startswith("draft")}
            for shapes in data["aggregate"]["idle_by_shape"]
        ]

    _doctor(folder, "dp_mtp", change)
    failed = _failed(_judge(folder, "dp_mtp")["dp_mtp"])
    assert failed == [
        "IDLE batches replayed as target_verify, draft_extend, draft_decode",
        "a rank idle in a verify slot idles in the draft's too",
    ]


def test_a_failed_run_fails_on_its_exit_status(runs, tmp_path):
    folder = _copy(runs, tmp_path)
    (folder / ".rc_dp_mtp").write_text("1\n")
    result = _judge(folder, "dp_mtp", "tp_mtp")
    assert _failed(result["dp_mtp"]) == ["finished (rc 0, no hang)"]
    assert result["tp_mtp"]["ok"]
    assert main(["dp_mtp", "--out", str(folder), "--requests", "6", "--spec-steps", "40"]) == 1


def test_a_missing_run_fails_every_check(tmp_path):
    result = judge(["dp_mtp"], [tmp_path], requests=REQUESTS)["dp_mtp"]
    assert not result["ok"] and result["rc"] is None
    assert "finished (rc 0, no hang)" in _failed(result)
    assert "every replay verified against eager" in _failed(result)


def test_the_script_parses_and_refuses_an_unknown_step(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = _script(tmp_path, "tp_mtp", "tp_bogus", timeout=30)
    assert done.returncode == 2
    assert "unknown step tp_bogus" in done.stdout
    assert not (tmp_path / ".rc_tp_mtp").exists()  # nothing ran
