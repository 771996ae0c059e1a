"""``python -m planner decode --tp / --dp-attention`` end to end, and its refusals.

The CLI spawns two gloo ranks here; each prints its line, rank 0 the aggregate and the
JSON. Bad values are refused before any rank starts, naming the flag's config field.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.cli import planner_cli


def _rank_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("rank ")]


def _decode(*flags, env=None, timeout=180):
    return planner_cli("decode", "--quiet", "--requests", "6", *flags, env=env, timeout=timeout)


@pytest.mark.parametrize("flag", ["--tp", "--dp-attention"])
def test_two_ranks_serve_and_rank_0_aggregates(flag, tmp_path):
    out = tmp_path / "run.json"
    draft = ["--draft", "mtp", "--draft-tokens", "3"] if flag == "--dp-attention" else []
    done = _decode(flag, "2", "--json", str(out), "--digests", "--dp-split", "blocks", *draft)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0/2" in done.stdout and "rank 1/2" in done.stdout
    assert "aggregate:" in done.stdout
    data = json.loads(out.read_text())
    total = data["aggregate"]
    assert total["world"] == 2 and total["agree"] and min(total["graph_replays"]) > 0
    # each rank's line and the aggregate count the same replays (the draft's graphs too)
    said = [int(re.search(r"tok/s, (\d+) replays", line)[1]) for line in _rank_lines(done)]
    assert said == total["graph_replays"] == [r["graph_replays"] for r in data["ranks"]]
    assert not total["interrupted"] and len(set(total["loop_steps"])) == 1
    if flag == "--tp":
        assert total["requests_finished"] == 6  # one workload, served by both ranks together
        assert total["tokens_equal_across_ranks"]
        assert total["digest_checks"][0] == total["signature_checks"][0] > 0
        assert total["digests_every_forward"]
    else:
        assert total["requests_finished"] == 6  # split over the ranks
        assert len(data["tokens"]) == 6
        # with an MTP draft: idle replicas ran verify- and draft-shaped IDLE batches
        shapes = {k for rank in total["idle_by_shape"] for k in rank}
        assert "target_verify" in shapes, total["idle_by_shape"]


def test_under_torchrun_each_process_is_one_rank(tmp_path):
    """``torchrun`` sets the launch variables: nothing is spawned, each process is a rank."""
    out = tmp_path / "run.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "planner",
        "decode",
        "--quiet",
        "--requests",
        "6",
        "--dp-attention",
        "2",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert [line[:8] for line in lines] == ["rank 0/2", "rank 1/2"]  # in rank order
    total = json.loads(out.read_text())["aggregate"]
    assert total["agree"] and total["requests_finished"] == 6


@pytest.mark.parametrize(
    ("flags", "env", "field"),
    [
        # a value a flag set is reported on the flag (the message names the config key too)
        (["--tp", "3"], None, "--tp"),  # the tiny model's 8 heads
        (
            ["--tp", "2", "--dp-attention", "2", "--compare-plain", "--draft", "ngram"],
            None,
            "--compare-plain",
        ),
        (["--tp", "2", "--dist-backend", "nccl"], None, "--dist-backend"),
        (["--tp", "2", "--save-weights", "w.safetensors"], None, "--save-weights"),
        (
            [],
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "distributed.dp_attention",
        ),
    ],
)
def test_bad_values_name_the_field(flags, env, field):
    done = _decode(*flags, env=env, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"[{field}]" in done.stderr, done.stderr


def test_zero_ranks_is_a_usage_error():
    done = _decode("--tp", "0", timeout=30)
    assert done.returncode == 2 and "--tp" in done.stderr and ">= 1" in done.stderr


def _rank(requests: int, tokens: int, **extra) -> dict:
    return {
        "wall_seconds": 2.0,
        "generated_tokens": tokens,
        "requests_finished": requests,
        "graph_replays": 10,
        "verified_replays": 0,
        "debug": False,
        "tokens": {0: [1, 2]},
        "signature_checks": 10,
        "digest_checks": 10,
        **extra,
    }


def test_aggregate_counts_a_tensor_parallel_workload_once():
    """TP ranks serve one workload together; DP replicas serve disjoint requests; in a
    TP x DP job each replica's TP rank 0 counts for it."""
    from dsv32_engine.serving.launch import aggregate

    tp_extra = {"checks_by_mode": {"decode": 10}}
    tp = aggregate(2, 1, [_rank(4, 100, **tp_extra), _rank(4, 100, **tp_extra)])
    assert (tp["requests_finished"], tp["generated_tokens"], tp["tokens_per_second"]) == (
        4,
        100,
        50,
    )
    assert tp["layout"] == "tp" and tp["agree"]
    assert tp["every_replay_verified"] is None  # no debug mode: nothing was compared
    dp_extra = {
        "idle_forwards": 0,
        "idle_by_shape": {},
        "peer_eager_forwards": 0,
        "replays_by_size": {},
        "forwards_by_size": {},
        "ffn_exchanges": 3,
        "loop_steps": 5,
    }
    dp = aggregate(1, 2, [_rank(3, 60, **dp_extra), _rank(1, 40, **dp_extra)])
    assert (dp["requests_finished"], dp["generated_tokens"], dp["tokens_per_second"]) == (
        4,
        100,
        50,
    )
    both = {**tp_extra, **dp_extra}
    ranks = [_rank(3, 60, **both), _rank(3, 60, **both), _rank(1, 40, **both), _rank(1, 40, **both)]
    job = aggregate(2, 2, ranks)
    assert job["layout"] == "tp_x_dp_attention" and job["agree"]
    assert (job["requests_finished"], job["generated_tokens"]) == (4, 100)
    ranks[3]["tokens"] = {0: [1, 3]}  # a TP peer that decoded otherwise
    assert not aggregate(2, 2, ranks)["agree"]
