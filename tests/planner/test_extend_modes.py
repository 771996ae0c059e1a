"""Extend, mixed and idle batches through the planner: exact plans, door checks, replays.

Every field of an extend plan is checked against a plain Python reference on random
ragged batches; at least ten new kinds of bad input are refused with a ``PlanError``
naming the field before any op runs (and the next good batch still plans right); idle
batches plan and replay with every row padding; a fuzz drives random sequences of
decode, extend, mixed and idle batches.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from backends.nsa.extend_ops import ROW_ALIGN
from planner import BatchError, ForwardBatch, ForwardMode, Limits, PlanError, Planner
from planner.debug import diff_plans, padding_violations
from planner.program import Step
from tests.support.batches import idle_batch, make_pool, random_batch

MAX_BATCH, MAX_CTX, PAGE, TOPK = 6, 256, 64, 16
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=5)
SLOTS = int(TABLE.max()) + 1


def _planner(budget: int = 1 << 30, **limits) -> Planner:
    limits = {
        "max_batch": MAX_BATCH,
        "max_context": MAX_CTX,
        "num_sms": 8,
        "kv_slots": SLOTS,
    } | limits
    options = {"nsa": {"topk": TOPK, "indexer_logits_bytes": budget}}
    return Planner(["nsa", "paged"], Limits(**limits), options=options)


def extend_batch(rng: random.Random, *, mode=ForwardMode.EXTEND, bs=None) -> ForwardBatch:
    """Random requests, each adding 1..its KV length tokens after a random cached prefix."""
    bs = bs or rng.randint(1, MAX_BATCH)
    pools = rng.sample(range(1, TABLE.shape[0]), bs)
    lens = [rng.randint(1, MAX_CTX) for _ in range(bs)]
    new = [rng.randint(1, min(n, 40)) for n in lens]
    if mode is ForwardMode.MIXED:
        new[0] = 1  # at least one decode request
    locs = [int(TABLE[p, q]) for p, n, e in zip(pools, lens, new) for q in range(n - e, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(pools, dtype=torch.int32),
        req_to_token=TABLE,
        out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        mode=mode,
        extend_lens_cpu=torch.tensor(new, dtype=torch.int32),
    )


def logit_rows(new: list[int], n: int) -> list[list[int]]:
    """Each request's last ``n`` rows, its first repeated where it has fewer tokens."""
    out, end = [], 0
    for e in new:
        start, end = end, end + e
        out.append([max(end - n + i, start) for i in range(n)])
    return out


def expected(batch: ForwardBatch) -> dict[str, list]:
    """Every extend-plan field, the slow obvious way."""
    lens, new = batch.seq_lens_cpu.tolist(), batch.extend_lens_cpu.tolist()
    pools = batch.req_pool_indices.tolist()
    out = {k: [] for k in ("positions", "token_request", "kv_lens", "ks", "ke", "topk_lens")}
    kv_start = 0
    for b, (n, e) in enumerate(zip(lens, new)):
        for i in range(e):
            p = n - e + i
            out["positions"].append(p)
            out["token_request"].append(b)
            out["kv_lens"].append(p + 1)
            out["ks"].append(kv_start)
            out["ke"].append(kv_start + p + 1)
            out["topk_lens"].append(min(p + 1, TOPK))
        kv_start += n
    out["kv_slots"] = [int(TABLE[p, j]) for p, n in zip(pools, lens) for j in range(n)]
    out["logit_rows"] = logit_rows(new, 1)
    locs = batch.out_cache_loc.tolist()
    out["cache_pages"] = [[loc // PAGE for loc in locs], [loc % PAGE for loc in locs]]
    return out


@pytest.mark.parametrize("seed", range(25))
def test_extend_plans_equal_the_reference(seed):
    rng = random.Random(seed)
    mode = rng.choice([ForwardMode.EXTEND, ForwardMode.MIXED])
    batch = extend_batch(rng, mode=mode)
    budget = rng.choice([1 << 12, 1 << 14, 1 << 30])
    plans = _planner(budget).plan(batch)
    assert plans.mode is mode and set(plans) == {"nsa"}  # paged plans no ragged mode
    plan, want = plans["nsa"], expected(batch)
    assert plan.positions.tolist() == want["positions"]
    assert plan.token_request.tolist() == want["token_request"]
    assert plan.kv_lens.tolist() == want["kv_lens"]
    assert plan.kv_ranges[0].tolist() == want["ks"] and plan.kv_ranges[1].tolist() == want["ke"]
    assert plan.topk_lens.tolist() == want["topk_lens"]
    assert plan.kv_slots.tolist() == want["kv_slots"]
    assert plan.logit_rows.tolist() == want["logit_rows"]
    assert plan.cache_pages.tolist() == want["cache_pages"]
    assert plan.max_seq_len == max(batch.seq_lens_cpu.tolist())
    # The indexer's chunk rows follow from the width and the budget alone (extend_ops).
    width = plan.max_seq_len
    assert plan.indexer_chunk_rows == max(1, budget // (-(-width // ROW_ALIGN) * ROW_ALIGN * 4))


@pytest.mark.parametrize("next_n", [2, 4])
def test_a_mixed_batch_heads_the_last_next_n_rows_of_every_request(next_n):
    """Speculating (``next_n > 1``), a mixed batch's logit rows are each request's last
    ``next_n`` (a verify request's rows; a shorter request repeats its first), an extend
    batch's its last alone; a bucket's padding requests all point at the last real row."""
    planner = _planner(next_n=next_n)
    rng = random.Random(next_n)
    for _ in range(8):
        batch = extend_batch(rng, mode=ForwardMode.MIXED)
        new = batch.extend_lens_cpu.tolist()
        new[-1:] = [next_n]  # a verify request's rows, and short ones (new[0] is 1)
        locs = batch.out_cache_loc.tolist()[: sum(new[:-1])]
        pool, length = int(batch.req_pool_indices[-1]), int(batch.seq_lens_cpu[-1])
        length = max(length, next_n)
        locs += [int(TABLE[pool, q]) for q in range(length - next_n, length)]
        lens = batch.seq_lens_cpu.clone()
        lens[-1] = length
        batch = dataclasses.replace(
            batch,
            seq_lens_cpu=lens,
            extend_lens_cpu=torch.tensor(new, dtype=torch.int32),
            out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        )
        mixed = planner.plan(batch)["nsa"]
        assert mixed.logit_rows.tolist() == logit_rows(new, next_n)
        extend = planner.plan(dataclasses.replace(batch, mode=ForwardMode.EXTEND))["nsa"]
        assert extend.logit_rows.tolist() == logit_rows(new, 1)
        tokens = sum(new)
        padded = planner.plan(batch, pad_to=MAX_BATCH, pad_tokens=tokens + 3)["nsa"]
        rows = padded.logit_rows.tolist()
        assert rows[: batch.bs] == logit_rows(new, next_n)
        assert rows[batch.bs :] == [[tokens - 1] * next_n] * (MAX_BATCH - batch.bs)


def test_decode_and_verify_plans_are_unchanged_by_extend_support():
    """Decode is the case where every extend length is 1: giving them explicitly changes nothing."""
    rng = random.Random(1)
    planner = _planner()
    batch = random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX)
    ones = torch.ones(batch.bs, dtype=torch.int32)
    explicit = dataclasses.replace(batch, extend_lens_cpu=ones)
    assert not diff_plans(planner.plan(batch), planner.plan(explicit))


def _good_extend() -> ForwardBatch:
    return extend_batch(random.Random(7), bs=3)


def _ext(**change) -> ForwardBatch:
    return dataclasses.replace(_good_extend(), **change)


def _lens(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _bad_cases() -> dict[str, tuple[ForwardBatch, str]]:
    good = _good_extend()
    seq = good.seq_lens_cpu.tolist()
    new = good.extend_lens_cpu.tolist()
    empty = torch.zeros(0, dtype=torch.int32)
    decode = random_batch(random.Random(2), TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=3)
    return {
        "extend batch without extend lengths": (_ext(extend_lens_cpu=None), "extend_lens_cpu"),
        "extend length zero": (
            _ext(extend_lens_cpu=_lens(0, new[1], new[2] + new[0])),
            "extend_lens_cpu",
        ),
        "extend length negative": (
            _ext(extend_lens_cpu=_lens(-1, new[1], new[2] + new[0] + 1)),
            "extend_lens_cpu",
        ),
        "extend longer than the KV length (negative prefix)": (
            _ext(
                seq_lens_cpu=_lens(new[0], seq[1], seq[2])
                if new[0] > 1
                else _lens(1, seq[1], seq[2]),
                extend_lens_cpu=_lens(new[0] + 1, new[1], new[2] - 1)
                if new[2] > 1
                else _lens(new[0] + 1, new[1] - 1, new[2]),
            ),
            "extend_lens_cpu",
        ),
        "extend lengths not int32": (
            _ext(extend_lens_cpu=good.extend_lens_cpu.long()),
            "extend_lens_cpu",
        ),
        "extend lengths wrong count": (
            _ext(extend_lens_cpu=good.extend_lens_cpu[:2]),
            "extend_lens_cpu",
        ),
        "extend lengths 2-D": (_ext(extend_lens_cpu=good.extend_lens_cpu[None]), "extend_lens_cpu"),
        "tokens past max_tokens": (_ext(), "extend_lens_cpu"),  # with a planner of max_tokens 4
        "out_cache_loc shorter than the tokens": (
            _ext(out_cache_loc=good.out_cache_loc[:-1].contiguous()),
            "out_cache_loc",
        ),
        "positions longer than the tokens": (
            _ext(positions=torch.zeros(good.num_tokens + 1, dtype=torch.int32)),
            "positions",
        ),
        "decode row with more than one token": (
            dataclasses.replace(decode, extend_lens_cpu=_lens(1, 2, 1)),
            "out_cache_loc",
        ),
        "decode rows declaring two tokens each": (
            dataclasses.replace(
                decode,
                extend_lens_cpu=_lens(2, 2, 2),
                out_cache_loc=torch.zeros(6, dtype=torch.int32),
            ),
            "extend_lens_cpu",
        ),
        "idle batch with requests": (
            dataclasses.replace(decode, mode=ForwardMode.IDLE),
            "seq_lens_cpu",
        ),
        "idle batch with cache locations": (
            ForwardBatch(
                seq_lens_cpu=empty,
                req_pool_indices=empty,
                req_to_token=TABLE,
                out_cache_loc=torch.zeros(2, dtype=torch.int32),
                mode=ForwardMode.IDLE,
            ),
            "out_cache_loc",
        ),
        "empty batch that is not idle": (
            ForwardBatch(
                seq_lens_cpu=empty,
                req_pool_indices=empty,
                req_to_token=TABLE,
                out_cache_loc=empty,
                mode=ForwardMode.EXTEND,
                extend_lens_cpu=empty,
            ),
            "seq_lens_cpu",
        ),
        "device extend lengths without the host copy": (
            _ext(extend_lens_cpu=None, extend_lens=good.extend_lens_cpu),
            "extend_lens_cpu",
        ),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_extend_input_is_refused_before_any_op(kind, monkeypatch):
    batch, field = BAD[kind]
    planner = _planner(max_tokens=4) if kind == "tokens past max_tokens" else _planner()
    launched = []
    real_run = Step.run
    monkeypatch.setattr(Step, "run", lambda step, *a, **k: launched.append(step.key))
    with pytest.raises(PlanError) as info:
        planner.plan(batch)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    assert launched == []
    monkeypatch.setattr(Step, "run", real_run)
    good = extend_batch(random.Random(9), bs=2) if kind != "tokens past max_tokens" else None
    if good is not None:  # the next good batch still plans correctly
        assert planner.plan(good)["nsa"].kv_slots.tolist() == expected(good)["kv_slots"]


def test_at_least_ten_new_kinds_are_catalogued():
    assert len(BAD) >= 10


def test_ragged_captures_and_padded_plans_name_their_token_bucket():
    """Ragged buckets are (bs, tokens): tests/planner/test_ragged_capture.py covers them."""
    planner = _planner()
    with pytest.raises(BatchError) as info:
        planner.capture(2, ForwardMode.EXTEND, req_to_token=TABLE)
    assert info.value.field == "tokens"
    with pytest.raises(BatchError) as info:
        planner.plan(_good_extend(), pad_to=MAX_BATCH)
    assert info.value.field == "pad_tokens"


def _idle() -> ForwardBatch:
    return idle_batch(TABLE)


def test_idle_batches_plan_as_one_padding_request_and_replay_on_a_decode_graph():
    planner = _planner()
    eager = planner.plan(_idle())
    assert eager.mode is ForwardMode.IDLE and eager.reqs == 1 and eager.real_reqs == 0
    pads = planner.program(ForwardMode.DECODE).pads
    assert not padding_violations(eager, pads, {"reqs": 0, "rows": 0, "tokens": 0})
    planner.capture(2, req_to_token=TABLE)
    replayed = planner.replay(_idle(), 2)
    planner.record(2)
    assert replayed.mode is ForwardMode.IDLE and replayed.real_reqs == 0
    assert not padding_violations(replayed, pads, {"reqs": 0, "rows": 0, "tokens": 0})
    planner.verify(_idle(), replayed)  # equal to the eager plan of the padded batch
    assert planner.plan(_idle())["nsa"].seq_lens.tolist() == [1]  # never an empty schedule


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_decode_extend_mixed_and_idle(seed):
    """Random sequences of every mode: replays equal eager bit for bit, pads hold,
    extend plans equal the reference, idle replays touch no real row."""
    rng = random.Random(seed)
    planner = _planner()
    sizes = [1, 4, MAX_BATCH]
    for bs in sizes:
        planner.capture(bs, req_to_token=TABLE)
    pads = planner.program(ForwardMode.DECODE).pads
    for _ in range(30):
        mode = rng.choice(list(ForwardMode))
        if mode is ForwardMode.TARGET_VERIFY:
            continue  # this planner's next_n is 1; verify is fuzzed with its own planner
        if mode.ragged:
            batch = extend_batch(rng, mode=mode)
            assert planner.plan(batch)["nsa"].kv_slots.tolist() == expected(batch)["kv_slots"]
            continue
        batch = (
            _idle()
            if mode is ForwardMode.IDLE
            else random_batch(rng, TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX)
        )
        size = next(s for s in sizes if s >= max(batch.bs, 1))
        replayed = planner.replay(batch, size)
        planner.record(size)
        eager = planner.plan(batch, pad_to=size)
        assert not diff_plans(replayed, eager)
        tokens = batch.bs
        assert not padding_violations(
            replayed, pads, {"reqs": batch.bs, "rows": tokens, "tokens": tokens}
        )
