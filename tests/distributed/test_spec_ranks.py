"""Speculative decoding on several gloo ranks, and TP x DP attention in one job.

Every layout serves the tiny model's workload and must produce, for every request, the
greedy tokens of one plain process (no speculation, no distributed code: float32 on the
CPU). On top of that:

- tensor parallel: every forward's signature agreed and (digests on) every plan field and
  input digested, the draft's forwards included (verify, draft extend, draft decode);
- data-parallel attention (debug on): every replay verified against a fresh eager plan;
  a replica without a batch replays an IDLE batch of its peers' shape (counted by shape),
  the same forwards at the same graph sizes on every rank, the FFN exchanges in lockstep;
- a rank that decides one verify differently fails every rank, naming the field.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.distributed import scenarios
from tests.distributed.ranks import run_ranks

WORKLOAD = {
    "loop.requests": 8,
    "loop.arrival_rate": 0.5,
    "loop.prompt_len": [4, 24],
    "loop.max_new_tokens": [6, 16],
    "planner.max_batch": 4,
    "graphs.sizes": [1, 2, 4],
}
NGRAM = {"speculative.draft": "ngram", "speculative.draft_tokens": 3}
MTP = {"speculative.draft": "mtp", "speculative.draft_tokens": 4}
MIXED = {"loop.mixed": True, "graphs.ragged": True, "loop.chunk_tokens": 20}
LAYOUTS = {
    "tp2_ngram": ({"distributed.tp": 2, "distributed.digests": True, **NGRAM}, 2),
    "tp2_mtp": ({"distributed.tp": 2, "distributed.digests": True, **MTP}, 2),
    "dp2_ngram": ({"distributed.dp_attention": 2, "planner.debug": True, **NGRAM}, 2),
    "dp2_mtp": ({"distributed.dp_attention": 2, "planner.debug": True, **MTP}, 2),
    # mixing: verify rows beside prompt chunks (cut to a small budget), in token buckets
    # (debug: every replay verified) or eagerly; a rank with nothing pads its peers' bucket
    "dp2_mtp_mixed": ({"distributed.dp_attention": 2, "planner.debug": True, **MTP, **MIXED}, 2),
    "dp2_ngram_mixed": (
        {"distributed.dp_attention": 2, **NGRAM, **MIXED, "graphs.ragged": False},
        2,
    ),
    "tp2_dp2": ({"distributed.tp": 2, "distributed.dp_attention": 2}, 4),
    "tp2_dp2_ngram": ({"distributed.tp": 2, "distributed.dp_attention": 2, **NGRAM}, 4),
}


@pytest.fixture(scope="module")
def plain_tokens() -> dict[str, list[int]]:
    return scenarios.single_tokens(WORKLOAD)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request, tmp_path_factory):
    extra, world = LAYOUTS[request.param]
    overrides = {**WORKLOAD, "distributed.dp_split": "blocks", **extra}
    ranks = run_ranks(
        tmp_path_factory.mktemp(request.param), "rank_engine", world, overrides=overrides
    )
    return request.param, extra, ranks


def _tp_dp(extra: dict) -> tuple[int, int]:
    return extra.get("distributed.tp", 1), extra.get("distributed.dp_attention", 1)


def test_greedy_tokens_equal_one_plain_process(layout_run, plain_tokens):
    name, extra, ranks = layout_run
    tp, dp = _tp_dp(extra)
    for rank in ranks:
        assert rank["error"] is None, rank["error"]
    served: dict[str, list[int]] = {}
    for replica in range(dp):
        peers = ranks[replica * tp : (replica + 1) * tp]
        assert all(r["tokens"] == peers[0]["tokens"] for r in peers), name  # TP peers agree
        assert not set(served) & set(peers[0]["tokens"])  # each request on one replica
        served.update(peers[0]["tokens"])
    assert served == plain_tokens, name
    if "draft" in str(extra):
        spec = ranks[0]["speculative"]
        assert spec["verify_steps"] > 0 and spec["mean_accept_length"] >= 1.0


def test_tensor_parallel_checks_every_forward_drafts_included(layout_run):
    name, extra, ranks = layout_run
    tp, _ = _tp_dp(extra)
    if tp == 1:
        pytest.skip("no tensor parallel in this layout")
    for rank in ranks:
        assert rank["signature_checks"] == rank["forwards"] + _draft_forwards(rank)
        if extra.get("distributed.digests"):
            assert rank["digest_checks"] == rank["signature_checks"]
        modes = rank["checks_by_mode"]
        if "mtp" in name:
            assert {"target_verify", "draft_extend", "draft_decode"} <= set(modes), modes
        elif "ngram" in name:
            assert "target_verify" in modes and "decode" not in modes, modes
        # the MTP layer's heads are sharded too: one all-reduce per target layer per forward
        # plus one per draft layer call (a draft decode: one per step)
        assert rank["attention_heads"] == 4


def _draft_forwards(rank: dict) -> int:
    """Draft forwards through a runner (the draft prefill reads the target's plans)."""
    spec = rank["speculative"] or {"draft_forwards": {}}
    forwards = spec["draft_forwards"]
    return forwards.get("draft_extend", 0) + forwards.get("draft_decode", 0)


def test_data_parallel_replicas_replay_their_peers_shape(layout_run):
    name, extra, ranks = layout_run
    tp, dp = _tp_dp(extra)
    if dp == 1:
        pytest.skip("no data-parallel attention in this layout")
    for key in ("replays_by_size", "forwards_by_size", "ffn_exchanges", "loop_steps"):
        assert all(r[key] == ranks[0][key] for r in ranks), key
    table = defaultdict(dict)
    for r, rank in enumerate(ranks):
        for step, slot, mode, own, phase, size in rank["trace"]:
            table[(step, slot)][r] = (mode, own, phase, size)
    for key, seen in table.items():
        assert sorted(seen) == list(range(len(ranks))), f"forward {key} ran on {sorted(seen)}"
        phases = {phase for _, _, phase, _ in seen.values()}
        assert len(phases) == 1, (key, seen)
        if phases == {"replay"}:
            assert len({size for *_, size in seen.values()}) == 1, (key, seen)
    shapes = defaultdict(int)
    for rank in ranks:
        for shape, count in rank["idle_by_shape"].items():
            shapes[shape] += count
    if "draft" in str(extra):
        assert shapes["target_verify"] > 0, shapes
        # no decode batch runs under speculation: a decode graph replay would be an idle
        # replica's decode-shaped batch in its peers' verify
        replayed = ranks[0]["replays_by_size"]
        assert not any(k.startswith("decode:") for k in replayed), replayed
        assert any(k.startswith("target_verify:") for k in replayed), replayed
    if "mtp" in name:
        assert shapes["draft_extend"] > 0 and shapes["draft_decode"] > 0, shapes
    if "mixed" in name:  # verify rows joined prompt chunks, on some replica
        assert sum(r["speculative"]["mixed_verify_steps"] for r in ranks) > 0
        assert "extend" not in {mode for r in ranks for _, _, mode, *_ in r["trace"]}
        if extra.get("graphs.ragged"):
            assert shapes["mixed"] > 0, shapes  # a replica padding its peers' bucket
            assert any(k.startswith("mixed:") for k in ranks[0]["replays_by_size"])
    if extra.get("planner.debug"):
        for rank in ranks:
            assert rank["verified_replays"] == rank["graph_replays"] > 0


@pytest.mark.parametrize("perturb", ["shorter", "token"])
def test_a_rank_that_accepts_otherwise_fails_every_rank(perturb, tmp_path):
    """Rank 1 decides one verify differently: its next forward's signature (a shorter
    request: lengths, positions) or, digests on, its input ids differ, and both ranks raise
    the same error naming the field."""
    overrides = {**WORKLOAD, "distributed.tp": 2, "distributed.digests": True, **NGRAM}
    ranks = run_ranks(tmp_path, "rank_engine", 2, overrides=overrides, perturb=perturb)
    assert ranks[1]["perturbed_at"], "no verify accepted two tokens to take one from"
    errors = [r["error"] for r in ranks]
    assert all(errors), errors
    assert errors[0] == errors[1]
    if perturb == "shorter":
        assert errors[0]["field"] in ("batch.max_len", "batch.batch_digest"), errors[0]
        assert "rank 1 has" in errors[0]["message"]
    else:
        assert errors[0]["field"] == "input.input_ids", errors[0]
        assert "rank 1 planned" in errors[0]["message"]
