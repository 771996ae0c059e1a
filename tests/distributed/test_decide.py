"""The data-parallel step decision alone (no processes): what every rank derives from the
gathered table, and the launch checks that need no group."""

from __future__ import annotations

import pytest
import torch

from dsv32_engine.distributed.agree import RankMismatch
from dsv32_engine.distributed.dp import Slot, decide, encode
from dsv32_engine.distributed.group import backend_for, env_rank, launched_by_torchrun
from planner.batch import ForwardMode
from planner.errors import ConfigError

D, E, M = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED
LADDER = (1, 2, 4, 8)
TOKENS = (16, 32, 64)
KV_BOUND = 500


def route(mode, bs, tokens=0, kv_tokens=0):
    """A runner without ragged graphs: extend and mixed batches run eagerly."""
    if mode.ragged:
        return None, "ragged"
    fits = [s for s in LADDER if s >= max(bs, 1)]
    return (fits[0], None) if fits else (None, "batch_too_large")


def ragged_route(mode, bs, tokens=0, kv_tokens=0):
    """A runner with token buckets (``GraphRunner.route``'s rules)."""
    if not mode.ragged:
        return route(mode, bs)
    if kv_tokens > KV_BOUND:
        return None, "kv_tokens_over_bound"
    fits = [s for s in TOKENS if s >= max(tokens, 1)]
    return (fits[0], None) if fits else (None, "tokens_over_buckets")


def table(*ranks, step=3):
    return [encode(step, True, slots) for slots in ranks]


def test_skipped_replayed_and_eager_slots():
    plan = decide(table([Slot(), Slot(D, 3, 3)], [Slot(), Slot(D, 1, 1)]), 2, route)
    skip, dec = plan.slots
    assert not skip.run
    assert dec.run and dec.size == 4 and dec.modes == ("decode", "decode")
    # an empty rank's slot still runs (it replays an idle batch of the agreed size)
    plan = decide(table([Slot(), Slot(D, 5, 5)], [Slot(), Slot()]), 2, route)
    assert plan.slots[1].size == 8 and plan.slots[1].modes == ("decode", "idle")
    # someone extends: every rank runs that slot eagerly, padded to the most tokens
    plan = decide(table([Slot(E, 2, 40), Slot()], [Slot(), Slot()]), 2, route)
    assert plan.slots[0].run and plan.slots[0].size is None and plan.slots[0].max_rows == 40
    # larger than every graph: eager together
    plan = decide(table([Slot(), Slot(D, 9, 9)], [Slot(), Slot(D, 1, 1)]), 2, route)
    assert plan.slots[1].size is None and plan.slots[1].max_rows == 9


def test_ragged_slots_agree_on_one_token_bucket():
    """One rank's prefill no longer sends its peers eager: every rank replays the token
    bucket of the most tokens (an idle rank its null extend), within the KV bound."""
    plan = decide(table([Slot(E, 2, 40, 300), Slot()], [Slot(), Slot()]), 2, ragged_route)
    assert plan.slots[0].size == 64 and plan.slots[0].modes == ("extend", "idle")
    plan = decide(table([Slot(E, 1, 10, 50)], [Slot(E, 3, 20, 80)]), 1, ragged_route)
    assert plan.slots[0].size == 32
    # over the KV bound, over the largest bucket, or modes that differ: eager together
    for ranks in (
        ([Slot(E, 1, 10, 400)], [Slot(E, 1, 10, 200)]),  # 400 + 200 is fine: max 400
        ([Slot(E, 1, 10, 501)], [Slot()]),
        ([Slot(E, 1, 65, 100)], [Slot()]),
        ([Slot(E, 1, 10, 100)], [Slot(M, 2, 11, 100)]),
    ):
        size = decide(table(*ranks), 1, ragged_route).slots[0].size
        assert size == (16 if ranks[0][0].kv_tokens == 400 else None), ranks


def test_activity_and_steps():
    rows = [encode(7, False, [Slot(), Slot()]), encode(7, False, [Slot(), Slot()])]
    assert not decide(rows, 2, route).active
    rows[1] = encode(7, True, [Slot(), Slot()])
    assert decide(rows, 2, route).active  # one rank with work keeps every rank looping
    rows[1] = encode(8, True, [Slot(), Slot()])
    with pytest.raises(RankMismatch, match="different steps") as info:
        decide(rows, 2, route)
    assert info.value.field == "step"


def test_launch_checks():
    assert backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(ConfigError, match="NCCL") as info:
        backend_for(torch.device("cpu"), "nccl")
    assert info.value.field == "distributed.backend"
    env = {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launched_by_torchrun(env) and not launched_by_torchrun({"RANK": "0"})
    with pytest.raises(ConfigError) as info:
        env_rank(env)
    assert info.value.field == "RANK"
    assert env_rank({**env, "RANK": "1", "LOCAL_RANK": "1"}) == (1, 2, 1)
