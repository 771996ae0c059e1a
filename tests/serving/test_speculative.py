"""Speculative decoding in the loop: greedy speculative decoding emits plain decoding's tokens.

For both drafts (n-gram, and the MTP layer: draft extend and multi-step draft decode) and
2, 3, 4 and 8 tokens per verify, every request's tokens equal non-speculative decoding's,
through the planner and the (emulated) graph runner, at padded batch sizes. The model has
32 index heads: with the tiny preset's 4, index scores tie at exactly 0 and either key may
be kept (DSV32.md), which would make any exact comparison a coin toss.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from benchmarks.loop import spec_decode
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.accept import accept_greedy
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.ngram import NgramDraft
from dsv32_engine.serving.report import summarize
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.run_config import load_run_config
from planner.batch import ForwardMode
from tests.support.cli import planner_cli

CFG = DSV32Config.model_validate({**DSV32Config.tiny().model_dump(), "index_n_heads": 32})
LOOP = {
    "loop.requests": 6,
    "loop.prompt_len": [1, 30],
    "loop.max_new_tokens": [2, 20],
    "loop.arrival_rate": 2.0,
    "planner.max_batch": 4,
    "planner.max_context": 128,
    "model.overrides": {"index_n_heads": 32},
    "graphs.sizes": [1, 2, 4],
}


@cache
def _model() -> DSV32Model:
    return DSV32Model(CFG, seed=0, device="cpu", dtype=torch.float32)


def _run(**speculative):
    overrides = {**LOOP, **{f"speculative.{k}": v for k, v in speculative.items()}}
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    return engine, engine.run(progress=False, keep_tokens=True)


@cache
def _plain() -> dict[int, list[int]]:
    return _run()[1].tokens


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
@pytest.mark.parametrize("tokens", [2, 3, 4, 8])
def test_speculative_greedy_tokens_equal_plain_decoding(draft, tokens):
    engine, result = _run(draft=draft, draft_tokens=tokens)
    plain = _plain()
    assert len(result.tokens) == len(plain) == 6
    for rid, want in plain.items():
        assert result.tokens[rid] == want, f"request {rid} ({draft}, {tokens} tokens)"
    summary = summarize(engine, result)
    spec = summary["speculative"]
    assert spec["verify_steps"] == summary["steps_by_mode"]["target_verify"] > 0
    assert spec["mean_accept_length"] > 1.0  # drafts do get accepted: accept lengths vary
    assert summary["eager_fallbacks"] == {}  # every verify replayed a graph
    if draft == "mtp":
        forwards = spec["draft_forwards"]
        assert forwards["draft_extend"] > 0 and forwards["draft_prefill"] > 0
        for runner in engine.speculation.runners.values():
            assert not runner.stats.eager, runner.stats.eager  # draft batches replayed graphs
            assert runner.stats.steps > 0
        assert (forwards.get("draft_decode", 0) > 0) == (tokens > 2)  # k = tokens - 2 steps


MIXED_CASES = [
    # (draft, tokens per verify, ragged graphs: emulated token-bucket replays, else eager)
    ("ngram", 4, False),
    ("ngram", 3, True),
    ("mtp", 4, False),
    ("mtp", 4, True),
    ("mtp", 2, True),
    ("mtp", 8, False),
]


@pytest.mark.parametrize(("draft", "tokens", "ragged"), MIXED_CASES)
def test_speculating_mixed_steps_emit_plain_greedy_tokens(draft, tokens, ragged):
    """Mixing (``loop.mixed``), a step's verify rows share its forward with prompt chunks
    cut to the step's budget, replayed from token buckets (debug mode: every replay equal
    to a fresh eager plan) or eagerly; every request's tokens are still plain greedy
    decoding's, and the MTP draft catches up on both kinds of row over the mixed plans."""
    budget = 3 * tokens + 4  # (max_batch - 1) verifying requests' rows and a few prompt tokens
    overrides = {
        **LOOP,
        "speculative.draft": draft,
        "speculative.draft_tokens": tokens,
        "loop.mixed": True,
        "loop.chunk_tokens": budget,
        "graphs.ragged": ragged,
        "planner.debug": ragged,
    }
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    steps: list[tuple[int, int]] = []  # (verify rows, prompt tokens) of every mixed step
    build = engine.scheduler.build_extend

    def recorded(work, mode, *args, drafts=None, **kwargs):
        if drafts is not None:
            rows = sum(n for (_, n), d in zip(work, drafts) if d is not None)
            steps.append((rows, sum(n for _, n in work) - rows))
        return build(work, mode, *args, drafts=drafts, **kwargs)

    engine.scheduler.build_extend = recorded
    result = engine.run(progress=False, keep_tokens=True)
    assert result.tokens == _plain()
    summary = summarize(engine, result)
    spec = summary["speculative"]
    assert spec["mixed_verify_steps"] > 0 and spec["mean_accept_length"] > 1.0
    assert summary["steps_by_mode"]["mixed"] == len(steps) > 0
    assert "extend" not in summary["steps_by_mode"]  # every prompt chunk ran mixed
    assert all(rows % tokens == 0 and rows + chunk <= budget for rows, chunk in steps)
    assert any(rows and chunk for rows, chunk in steps)  # verify rows beside a chunk
    assert any(rows + chunk == budget for rows, chunk in steps)  # a chunk cut to the budget
    runner = engine.runner
    if ragged:
        assert summary["eager_fallbacks"] == {} and not runner.stats.ragged
        assert any(mode == "mixed" for mode, _ in runner.stats.replays)
        stats = engine.planner.stats  # the drafts' replays too: one planner
        assert stats.verified == stats.batches["replay"] >= runner.stats.steps > 0
    else:
        assert runner.stats.ragged["mixed"] == len(steps)
    if draft == "mtp":
        forwards = spec["draft_forwards"]
        assert forwards["draft_mixed"] == len(steps) and "draft_prefill" not in forwards
        assert forwards["draft_extend"] > 0  # verify-only steps keep their graph step


@pytest.mark.parametrize("ragged", [False, True])
def test_the_mtp_draft_caught_up_in_a_mixed_step_proposes_what_it_proposes_apart(ragged):
    """Greedy output cannot tell a good draft from a bad one (acceptance only); the drafts
    can. Under a budget that never binds, the loop runs the same rounds mixing or not, so
    the MTP draft's catch-up in one forward over a mixed step's plans (its prompt rows and
    verify rows) must propose every request exactly the drafts its draft prefill and draft
    extend propose apart."""

    def drafts(mixed: bool) -> tuple[dict[int, list[tuple[int, ...]]], int]:
        overrides = {
            **LOOP,
            "loop.arrival_rate": 0.5,  # arrivals while others decode: verify beside chunks
            "speculative.draft": "mtp",
            "loop.mixed": mixed,
            "graphs.ragged": ragged and mixed,
        }
        engine = DecodeEngine(load_run_config(None, overrides), model=_model())
        spec, seen = engine.speculation, {}
        accept = spec.accept

        def recorded(requests, *args, **kwargs):
            out = accept(requests, *args, **kwargs)  # the drafts' values read by now
            for request in requests:
                seen.setdefault(request.rid, []).append(tuple(request.drafts))
            return out

        spec.accept = recorded
        engine.run(progress=False)
        return seen, spec.stats.mixed_verify_steps

    apart, none = drafts(False)
    mixed, steps = drafts(True)
    assert none == 0 and steps > 0
    assert mixed == apart


@pytest.mark.parametrize("mixed", [False, True], ids=["apart", "mixed_ragged"])
def test_the_draft_caught_up_over_a_prompt_is_the_mtp_layer_over_the_whole_prompt(mixed):
    """The MTP draft catches up on a prompt inside the target's chunk forwards, its ids each
    row's next token: staged by the host inside the prompt (also at a chunk's cut), the
    target's own token at the row that ends it. Whatever the chunks (16-token steps shared
    with other requests' rows), the first draft after the prompt must be the MTP layer's
    over the whole prompt at once, fed the prompt's next tokens and the target's first
    token, on fresh caches: an independent reference of both kinds of id."""
    overrides = {
        **LOOP,
        "loop.prompt_len": [10, 30],
        "loop.chunk_tokens": 16,
        "speculative.draft": "mtp",
        "speculative.draft_tokens": 4,
        "loop.mixed": mixed,
        "graphs.ragged": mixed,
    }
    config = load_run_config(None, overrides)
    engine = DecodeEngine(config, model=_model())
    spec, firsts = engine.speculation, {}
    caught_up = spec.caught_up

    def recorded(*args, **kwargs):
        before = len(spec._pending)
        caught_up(*args, **kwargs)
        for requests, tokens, hidden in spec._pending[before:]:
            for request, token, state in zip(requests, tokens, hidden):
                firsts.setdefault(request.rid, (list(request.prompt), int(token), state.clone()))

    spec.caught_up = recorded
    engine.run(progress=False)
    assert len(firsts) >= 4
    if mixed:
        assert spec.stats.mixed_verify_steps > 0
    whole = {**overrides, "loop.chunk_tokens": 64, "loop.mixed": False, "graphs.ragged": False}
    for prompt, token, hidden in firsts.values():
        fresh = DecodeEngine(load_run_config(None, whole), model=_model())
        request = Request(rid=0, prompt=prompt, max_new_tokens=2, arrival_step=0)
        fresh.scheduler.arrive([request])
        assert fresh.scheduler.admit(fresh.limits.next_n) == 1
        batch, ids = fresh.scheduler.build_extend([(request, len(prompt))], ForwardMode.EXTEND)
        plans = fresh.planner.plan(batch)
        out = fresh.model(ids, plans, fresh.cache, hidden=True)
        first = int(out["logits"].argmax(dim=-1)[-1])
        mtp = fresh.speculation.mtp
        next_ids = torch.tensor([*prompt[1:], first], dtype=torch.int64)
        want = mtp(next_ids, out["hidden"].to(mtp.dtype), plans, fresh.speculation.cache)
        assert int(want["tokens"][-1]) == token
        torch.testing.assert_close(want["hidden"][-1], hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixed", [False, True], ids=["apart", "mixed"])
def test_the_host_reads_the_mtp_drafts_after_it_launched_their_verify(mixed):
    """The MTP draft's tokens stay on the device: the next verify feeds them from there
    (``TokenIds.draft_of``), and the host reads them with that verify's tokens, so it never
    waits for the draft forwards before it builds and launches the next step. Every read
    started behind a draft decode is taken only after a target forward was launched since
    (a read taken at once, the old synchronous draft decode, fails), and the tokens still
    equal plain greedy decoding's."""
    overrides = {
        **LOOP,
        "loop.arrival_rate": 0.5,
        "speculative.draft": "mtp",
        "speculative.draft_tokens": 4,
        "loop.mixed": mixed,
        "graphs.ragged": mixed,
    }
    engine = DecodeEngine(load_run_config(None, overrides), model=_model())
    spec, planner, events = engine.speculation, engine.planner, []
    in_draft_decode = False
    read_later, finish_step, target_step = planner.read_later, spec.finish_step, engine.runner.step

    def traced_read_later(values):
        read = read_later(values)
        if in_draft_decode:
            events.append(("draft read", id(read)))
            get = read.get

            def traced_get():
                events.append(("draft taken", id(read)))
                return get()

            read.get = traced_get
        return read

    def traced_finish_step():
        nonlocal in_draft_decode
        in_draft_decode = True
        try:
            finish_step()
        finally:
            in_draft_decode = False

    def traced_target_step(*args, **kwargs):
        events.append(("target", None))
        return target_step(*args, **kwargs)

    planner.read_later = traced_read_later
    spec.finish_step = traced_finish_step
    engine.runner.step = traced_target_step
    result = engine.run(progress=False, keep_tokens=True)
    started: dict[int, int] = {}
    taken = 0
    for at, (what, read) in enumerate(events):
        if what == "draft read":
            started[read] = at
        elif what == "draft taken":
            between = [e for e, _ in events[started[read] : at]]
            assert "target" in between, f"draft read {read} was taken before any verify launched"
            taken += 1
    assert taken >= 10
    assert result.tokens == _plain_like(overrides)


def _plain_like(overrides: dict) -> dict[int, list[int]]:
    """Plain greedy decoding's tokens of the workload ``overrides`` serve."""
    plain = {k: v for k, v in overrides.items() if not k.startswith("speculative.")}
    return (
        DecodeEngine(load_run_config(None, plain), model=_model())
        .run(progress=False, keep_tokens=True)
        .tokens
    )


def test_accept_keeps_the_agreeing_prefix_and_the_bonus_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([8], [2, 8]) == [2]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_ngram_draft_follows_the_latest_match_and_cycles():
    draft = NgramDraft(1, 3)
    assert draft.propose(0, [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # after "1 2" came "3"
    assert draft.propose(1, [7, 8, 7, 8, 7], 4) == [8, 7, 8, 7]  # the cycle, past its end
    assert draft.propose(2, [4, 5], 2) == [5, 5]  # no match: repeat the last token
    assert draft.propose(3, [40, 1, 2], 2) == [3, 9]  # another request taught "1 2 -> 3"


def test_the_cpu_speculative_config_serves_and_reports(tmp_path):
    """configs/dsv32-tiny-spec.yaml through the CLI (fewer requests): accept length, both
    throughputs, and speculative tokens equal to plain decoding's."""
    out = tmp_path / "summary.json"
    proc = planner_cli(
        "decode",
        "--config",
        "dsv32-tiny-spec",
        "--requests",
        "3",
        "--quiet",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "mean accept length" in proc.stdout and "with / without speculation" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["speculative"]["draft"] == "ngram"
    assert summary["plain"]["tokens_equal"] is True
    assert summary["plain"]["tokens_per_second"] > 0


def test_gpu_benchmark_script_smoke_mode(tmp_path):
    """``python -m benchmarks spec_decode --smoke``: plain, MTP, n-gram and plain again on the
    CPU."""
    assert spec_decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "spec_decode.json").read_text())
    runs = report["runs"]
    assert list(runs) == ["plain", "mtp", "ngram", "plain again"]
    assert runs["mtp"]["draft"] == "mtp" and runs["mtp"]["mean_accept_length"] >= 1.0
    assert all(r["requests_equal_to_plain"] == "2/2" for r in runs.values())  # exact on the CPU
