"""The pieces benchmarks (``benchmarks.host.eager_pieces``, ``benchmarks.host.replay_pieces``)
and the device check's (``benchmarks.host.device_check``) run on the CPU against the planner
as it is: each piece they time is a call the planner still makes, so a change to the core
that leaves them behind fails here, not in a GPU session."""

from __future__ import annotations

import json

from benchmarks.host import eager_pieces, replay_pieces

TINY = ["--batches", "2", "--context", "256", "--iters", "2", "--warmup", "1", "--device", "cpu"]


def test_eager_pieces_times_every_piece_of_an_eager_plan(tmp_path, capsys):
    out = tmp_path / "eager.json"
    assert eager_pieces.main([*TINY, "--out", str(out)]) == 0
    pieces = {r["piece"] for r in json.loads(out.read_text())["rows"]}
    assert {*eager_pieces.PLAN_PARTS, *eager_pieces.STAGE_PARTS} <= pieces
    assert any(p.startswith("launch nsa.") for p in pieces)
    assert "plan() outside its pieces" in capsys.readouterr().out


def test_replay_pieces_times_every_piece_of_a_replay_by_both_transports(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert replay_pieces.main([*TINY, "--flashinfer", "--out", str(out)]) == 0
    pieces = {r["piece"] for r in json.loads(out.read_text())["rows"]}
    for transport in replay_pieces.TRANSPORTS:
        for part in ("replay() whole", "door", "write slot", "transfer", "pointer check"):
            assert f"{transport}: {part}" in pieces
    assert "replay() outside its pieces" in capsys.readouterr().out


def test_the_device_check_benchmark_times_each_bucket(tmp_path, capsys):
    """``benchmarks/host/device_check.py`` on the CPU: the check alone, the planner's record and
    the floor per bucket (host times there, GPU times on a GPU)."""
    from benchmarks.host import device_check

    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--batches", "1", "4", "--max-context", "256", "--iters", "2"]
    assert device_check.main([*argv, "--warmup", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["bs"] for r in rows] == [1, 4]
    assert all(r["check"]["median_us"] > 0 and r["record"]["median_us"] > 0 for r in rows)
    assert "device check" in capsys.readouterr().out
