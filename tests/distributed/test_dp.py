"""Data-parallel attention on the CPU: two gloo ranks with their own requests, in lockstep.

The workload is split in contiguous blocks, with slow arrivals: rank 1 waits while rank
0's first requests run, rank 0 idles at the end, and in between the two batches differ
in size. Every step, both ranks must run the same forwards at the same graph size (the
plans' padded size, as the runner replayed them, recorded per forward: requests, or a
prompt chunk's token bucket), a rank without requests running an IDLE batch (in a prompt
chunk's slot, a one-token extend of the null request at the peer's token bucket); with
ragged graphs off, prompt chunks run eagerly on both. Greedy tokens must equal one process
serving every request alone.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.distributed import scenarios
from tests.distributed.ranks import run_ranks

WORKLOAD = {
    "loop.requests": 12,
    "loop.arrival_rate": 0.25,
    "loop.prompt_len": [4, 30],
    "loop.max_new_tokens": [4, 24],
    "planner.max_batch": 8,
    "distributed.dp_split": "blocks",
}
VARIANTS = {
    "graphs": {},
    "ragged_graphs": {"graphs.ragged": True},
    "mixed_eager": {"loop.mixed": True, "graphs.enabled": False},
    # one step ahead: the ranks agree on step N+1 before they read step N's tokens; ragged
    # graphs with mixing, where a slot some replica cannot replay runs eagerly on all
    "overlap_ragged_mixed": {"graphs.ragged": True, "loop.mixed": True, "loop.overlap": True},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def dp_run(request, tmp_path_factory):
    overrides = {**WORKLOAD, **VARIANTS[request.param]}
    dp = {**overrides, "distributed.dp_attention": 2}
    ranks = run_ranks(tmp_path_factory.mktemp(request.param), "rank_engine", overrides=dp)
    return request.param, overrides, ranks


def _by_forward(ranks):
    """(loop step, slot) -> every rank's (mode, own requests, phase, padded requests)."""
    table = defaultdict(dict)
    for r, rank in enumerate(ranks):
        for step, slot, mode, own, phase, reqs in rank["trace"]:
            table[(step, slot)][r] = (mode, own, phase, reqs)
    return table


def test_every_rank_runs_every_forward_at_one_size(dp_run):
    name, _, ranks = dp_run
    table = _by_forward(ranks)
    assert len(table) > 40
    unequal = empty = 0
    for key, seen in table.items():
        assert sorted(seen) == [0, 1], f"forward {key} ran on ranks {sorted(seen)} only"
        phases = {phase for _, _, phase, _ in seen.values()}
        assert len(phases) == 1, f"forward {key}: {seen}"  # all replay or all eager
        own = [o for _, o, _, _ in seen.values()]
        if phases == {"replay"}:
            sizes = {reqs for _, _, _, reqs in seen.values()}
            assert len(sizes) == 1, f"forward {key} replayed different sizes: {seen}"
            assert sizes.pop() >= max(own)
        unequal += len(set(own)) > 1
        empty += min(own) == 0 < max(own)
        for mode, o, phase, _ in seen.values():
            if o:
                assert mode != "idle", (key, seen)
            else:  # an IDLE batch, or in a replayed prompt-chunk slot the null extend
                assert mode == "idle" or (key[1] == 0 and phase == "replay"), (key, seen)
    assert unequal > 10 and empty > 5, (unequal, empty)
    assert all(r["idle_forwards"] > 0 for r in ranks)  # both ranks idle for stretches
    for key in ("replays_by_size", "forwards_by_size", "ffn_exchanges", "loop_steps"):
        assert ranks[0][key] == ranks[1][key], key
    replayed = set(ranks[0]["replays_by_size"])
    peer_eager = sum(r["peer_eager_forwards"] for r in ranks)
    if name == "ragged_graphs":  # one rank's prompt chunk: both replay its token bucket
        assert any(k.startswith("extend:") for k in replayed), replayed
        assert any(k.startswith("decode:") for k in replayed), replayed
        assert peer_eager == 0
        # a rank without a prompt chunk replayed its peer's bucket with the null extend
        idle_chunks = [
            seen
            for (_, slot), seen in table.items()
            if slot == 0 and min(o for _, o, _, _ in seen.values()) == 0
        ]
        assert idle_chunks and all(
            {phase for _, _, phase, _ in seen.values()} == {"replay"} for seen in idle_chunks
        )
    elif name == "graphs":  # prompt chunks eager (ragged graphs off, the default)
        assert len(replayed) >= 3, replayed  # several graph sizes, idle ones padded too
        assert not any(k.startswith("extend:") for k in replayed)
        assert peer_eager > 0  # a peer prefilled
    elif name == "overlap_ragged_mixed":  # prompt chunks and decodes replay ragged buckets
        assert any(k.startswith(("mixed:", "extend:")) for k in replayed), replayed
    else:
        assert ranks[0]["replays_by_size"] == {}


def test_greedy_tokens_equal_one_process(dp_run):
    _, overrides, ranks = dp_run
    merged = {**ranks[0]["tokens"], **ranks[1]["tokens"]}
    assert not set(ranks[0]["tokens"]) & set(ranks[1]["tokens"])  # each request on one rank
    single = scenarios.single_tokens({k: v for k, v in overrides.items() if "distributed" not in k})
    assert merged == single


def test_a_rank_that_skips_a_forward_fails_its_peer_instead_of_hanging(tmp_path):
    ranks = run_ranks(tmp_path, "skipped_exchange", forwards=3, timeout_s=2.0)
    first, second = ranks
    assert second["calls"] == 2 and second["error"] is None
    assert len(first["seen"]) == 2 and first["error"] is not None
    # the exchange's rows are every rank's, and each rank keeps its own
    assert first["seen"][0] == [[0.0] * 4] * 3 and second["seen"][0] == [[2.0] * 4] * 3
