"""The graph runner's ragged graphs: prompt chunks and mixed steps replayed per token bucket.

The tiny model's decode loop with emulated graphs: every extend and mixed step replays
the smallest token bucket that holds it (requests padded to ``max_batch``), greedy tokens
equal the loop with those steps eager, and a step past a stated bound (more tokens than
the largest bucket, more KV than ``Limits.ragged_kv_tokens``) runs eagerly, counted under
its reason and warned once.
"""

from __future__ import annotations

import bisect
import warnings

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from graphs.runner import KV_OVER_BOUND, TOKENS_OVER_BUCKETS, TOKENS_PAST_GRAPHS, GraphWarning
from graphs.sizes import MAX_PADDING, default_token_ladder, token_ladder
from planner.batch import ForwardMode
from planner.errors import ConfigError
from tests.support.engines import SMALL_LOOP, tiny_engine

LOOP = {**SMALL_LOOP, "loop.prompt_len": [3, 40], "loop.chunk_tokens": 16, "graphs.ragged": True}


def _serve(**overrides):
    engine = tiny_engine({**LOOP, **overrides}, share_model=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False, keep_tokens=True)
    said = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    return engine, result, said


@pytest.fixture(scope="module")
def eager_chunks():
    """The same loops with prompt chunks eager (ragged graphs off): the tokens to equal."""
    plain = _serve(**{"graphs.ragged": False})[1].tokens
    mixed = _serve(**{"graphs.ragged": False, "loop.mixed": True})[1].tokens
    return {False: plain, True: mixed}


def test_the_token_ladder_doubles_then_steps_by_quarters_and_never_equals_the_request_bucket():
    assert default_token_ladder(264, 8) == [16, 32, 64, 128, 256, 264]
    # past 256 tokens four buckets a doubling, each at most 1.25x the one below
    assert default_token_ladder(2048, 128) == [
        16, 32, 64, 129, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048
    ]  # fmt: skip
    assert default_token_ladder(600, 64)[-3:] == [448, 512, 600]  # the budget tops it
    assert default_token_ladder(100, 16) == [17, 32, 64, 100]  # 16 is the request bucket
    assert default_token_ladder(16, 16) == [15]  # at the top: one token down
    assert token_ladder(100, 16, [8, 40]) == [8, 40]
    assert default_token_ladder(320, 320) == [16, 32, 64, 128, 256, 319]  # the top, one down
    with pytest.raises(ConfigError) as err:
        token_ladder(100, 16, [8, 16])
    assert err.value.field == "token_sizes"
    with pytest.raises(ConfigError, match="exceeds max_tokens") as err:
        token_ladder(100, 16, [8, 101])
    assert err.value.field == "token_sizes"


@given(
    max_tokens=st.integers(1, 9000),
    reqs=st.integers(1, 512),
    tokens=st.integers(257, 9000),
)
def test_past_256_tokens_a_step_pads_by_less_than_a_quarter_of_its_tokens(max_tokens, reqs, tokens):
    ladder = default_token_ladder(max_tokens, reqs)
    assert ladder == sorted(set(ladder)) and reqs not in ladder
    assert all(1 <= size <= max_tokens for size in ladder)
    assume(ladder and tokens <= ladder[-1])
    bucket = ladder[bisect.bisect_left(ladder, tokens)]
    # one token more where a bucket stepped off the request bucket
    assert bucket - tokens < tokens * MAX_PADDING + (bucket - 1 == reqs)


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed"])
def test_every_forward_replays_and_tokens_equal_eager_chunks(eager_chunks, mixed):
    engine, result, said = _serve(**{"loop.mixed": mixed, "planner.debug": True})
    stats = engine.runner.stats
    assert said == [] and not stats.eager and not stats.ragged  # nothing eager at all
    ragged = ForwardMode.MIXED if mixed else ForwardMode.EXTEND
    buckets = {size for (mode, size), n in stats.replays.items() if mode == ragged.value and n}
    captured = engine.runner.captured_sizes(ragged)
    assert buckets and buckets <= set(captured)
    # every bucket up to the step's budget (16 tokens, decode rows included), in one mode:
    # a mixing loop plans its steps of chunks alone as mixed batches too
    ladder = engine.runner.token_sizes
    assert captured == ladder and ladder[-1] == 16
    other = ForwardMode.EXTEND if mixed else ForwardMode.MIXED
    assert engine.runner.captured_sizes(other) == []
    assert engine.planner.stats.verified == stats.graph_steps  # debug: each replay re-planned
    assert result.tokens == eager_chunks[mixed]
    # the summary reports each bucket's capture cost
    labels = set(stats.summary()["capture_costs"])
    assert {f"{ragged.value}/t{t}" for t in captured} <= labels
    assert f"capture {ragged.value}/t{engine.runner.token_sizes[0]}" in stats.render(200)
    summary = stats.summary()
    assert summary["ragged_replays"] == sum(
        n for (m, _), n in stats.replays.items() if m in ("extend", "mixed")
    )
    assert summary["ragged_replays"] > 0 and summary["planner_us_per_ragged_replay"] > 0


def test_past_the_stated_bounds_a_step_runs_eagerly_counted_and_said_once(eager_chunks):
    # buckets of at most 8 tokens: 16-token chunks do not fit; KV of at most 20 tokens
    engine, result, said = _serve(**{"graphs.token_sizes": [3, 8], "planner.ragged_kv_tokens": 20})
    stats = engine.runner.stats
    assert stats.eager[TOKENS_OVER_BUCKETS] > 0 and stats.eager[KV_OVER_BOUND] > 0
    assert any(mode == "extend" for mode, _ in stats.replays)  # the small ones still replay
    assert len(said) == 2  # once per reason, never per step
    for reason in (KV_OVER_BOUND, TOKENS_OVER_BUCKETS):
        assert sum(f"running eagerly ({reason}:" in s for s in said) == 1, said
    assert result.tokens == eager_chunks[False]


def test_past_ragged_max_tokens_a_step_runs_eagerly_by_design_and_tokens_are_the_same(
    eager_chunks,
):
    """``graphs.ragged_max_tokens`` tops the default ladder below the step budget: fewer
    graphs to capture, and a step past it is a ragged step run eagerly (counted as such,
    never warned, not a fallback), with the tokens of eager chunks."""
    engine, result, said = _serve(**{"graphs.ragged_max_tokens": 8})
    runner, stats = engine.runner, engine.runner.stats
    assert runner.token_sizes == default_token_ladder(8, 4) == [8]  # not the budget's 16
    assert runner.captured_sizes(ForwardMode.EXTEND) == [8]
    assert said == [] and not stats.eager  # by design: no warning, no fallback
    assert stats.ragged["extend"] > 0 and any(m == "extend" for m, _ in stats.replays)
    assert runner.route(ForwardMode.EXTEND, 2, 9, 20) == (None, TOKENS_PAST_GRAPHS)
    assert result.tokens == eager_chunks[False]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"graphs.ragged_max_tokens": 4}, "> 4 (planner.max_batch)"),
        ({"graphs.ragged_max_tokens": 8, "graphs.token_sizes": [3, 8]}, "unset with"),
    ],
    ids=["not_past_max_batch", "beside_a_list"],
)
def test_a_ragged_max_tokens_that_cannot_work_is_refused_by_name(overrides, expected):
    with pytest.raises(ConfigError) as err:
        tiny_engine({**LOOP, **overrides})
    assert err.value.field == "graphs.ragged_max_tokens" and expected in str(err.value)


def test_the_ragged_steps_benchmark_replays_and_agrees_with_eager(tmp_path, monkeypatch):
    """The GPU benchmark's smoke on the CPU, so the script cannot rot between GPU sessions:
    every batch replays a ragged bucket (no fallback), and its logits agree with the eager
    step's (on the CPU's float32 model, exactly)."""
    import json
    import sys

    from benchmarks.loop import ragged_steps

    out = tmp_path / "ragged.json"
    argv = ["ragged_steps", "--smoke", "--profile", "1", "--host-profile", "2", "--prefix", "24"]
    argv += ["--out", str(out)]  # the chunk continues a prompt: 24 cached tokens before it
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        ragged_steps.main()
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["prefix"] == 24
    assert [(r["decoding"], r["chunk"]) for r in rows] == [(2, 8), (2, 32), (4, 8), (4, 32)]
    # Only the routed buckets are captured, and they are the full default ladder's choice:
    # the batches pad as they would in a server (5 requests; chunks up to 32 tokens).
    ladder = default_token_ladder(32 + 5, 5)
    for r in rows:
        assert r["fallback"] is None
        assert r["bucket"] == min(s for s in ladder if s >= r["tokens"])
        assert r["same_argmax"] and r["max_abs_diff"] == 0.0
        assert r["planner_host_us_per_ragged_replay"] > 0
        assert set(r["profile"]) == {"graph", "eager"}  # CPU: no device kernels to count
        hosted = r["host_profile"]  # the replay alone, and profiled inside the steps
        assert hosted["alone"]["median_us"] > 0
        assert any("replay" in f["function"] for f in hosted["in_steps_top"] + hosted["alone_top"])


def test_the_ragged_replay_benchmark_times_cold_replays(tmp_path):
    """``ragged_replay --evict``: every variant timed with the caches written over before
    each call, the sizes each batch routed to within the captured buckets."""
    import json

    from benchmarks.host import ragged_replay

    out = tmp_path / "replay.json"
    argv = ["--max-batch", "16", "--context", "256", "--chunk", "24", "--decoding", "6"]
    argv += ["--req-buckets", "8", "16", "--token-buckets", "16", "32", "64"]
    argv += ["--warmup", "2", "--iters", "6", "--evict", "1", "--out", str(out)]
    assert ragged_replay.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["timed"]) == {"decode", "mixed", "floor", "floor+checks", "extend"}
    assert all(t["median_us"] > 0 and t["iters"] == 6 for t in result["timed"].values())
    assert "1 MB written before each" in result["table"]
    # the floor rows time the mixed batches: their tokens, and a row each in the table
    assert (
        result["tokens"]["floor"] == result["tokens"]["floor+checks"] == result["tokens"]["mixed"]
    )
    rows = [line.split()[0] for line in result["table"].splitlines()[3:]]
    assert rows[1:4] == ["mixed", "floor", "floor+checks"]


def test_the_ragged_replay_floor_checks_refuse_bad_input():
    """``floor+checks`` times checks that can fail: a repeated slot, a position that does not
    continue its request's KV, a slot past the cache are each refused; the good batch passes."""
    import torch

    from benchmarks.host.ragged_replay import Bounds, batch_inputs, check_inputs, ragged_batch
    from benchmarks.kernels.seed_stack import make_table

    table, pages = make_table(4, 256, torch.device("cpu"), 0)
    kv_slots = pages * 64
    good = batch_inputs(ragged_batch(table, ForwardMode.MIXED, [1, 2, 3], [40, 9, 30], [1, 1, 6]))
    bounds = Bounds(kv_slots=kv_slots, pool_rows=table.shape[0], context=256)
    check_inputs(good, bounds)

    def bad(field: int, at: int, value) -> tuple:
        arrays = [a.copy() for a in good]
        arrays[field][at] = value(arrays[field])
        return tuple(arrays)

    loc, pos = 3, 4
    cases = {
        "a slot repeated": bad(loc, 1, lambda a: a[0]),
        "positions do not continue": bad(pos, 4, lambda a: a[4] + 1),
        r"out_cache_loc outside": bad(loc, 2, lambda a: kv_slots),
    }
    for match, arrays in cases.items():
        with pytest.raises(ValueError, match=match):
            check_inputs(arrays, bounds)
