"""The loop one step ahead (``loop.overlap``): step N+1 is built and launched before step N's
tokens are read, each decode row's token taken on the device; the tokens must be the
synchronous loop's, and the races running ahead could open are refused by name.

On the CPU nothing runs beside the host, so these tests hold the loop's order and its
bookkeeping (tokens taken a step late, requests finished a step late, a step in flight at
the end), not its speed; a sampling that has not run yet is provoked by holding back the
write of the sampled tokens, and a slot written after its transfer by keeping an old slot.
"""

from __future__ import annotations

import pytest
import torch

from dsv32_engine.serving.engine_settings import resolve_overlap
from dsv32_engine.serving.token_ids import TokenIds, last_of
from planner import ConfigError, ForwardMode, ReplayError
from tests.support.engines import SMALL_LOOP, tiny_engine

VARIANTS = {
    "decode": {},
    "chunked prefill": {"loop.chunk_tokens": 4},
    "mixed": {"loop.chunk_tokens": 4, "loop.mixed": True},
    "ragged graphs, mixed": {"loop.chunk_tokens": 5, "loop.mixed": True, "graphs.ragged": True},
    "eager": {"graphs.enabled": False, "loop.chunk_tokens": 4},
    "copy staging": {"planner.staging_in_graph": False},
}


def _run(overlap: bool, **overrides):
    engine = tiny_engine({**SMALL_LOOP, **overrides, "loop.overlap": overlap}, share_model=True)
    return engine, engine.run(progress=False, keep_tokens=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_step_ahead_gives_the_synchronous_tokens(variant):
    _, sync = _run(False, **VARIANTS[variant])
    engine, ahead = _run(True, **VARIANTS[variant])
    assert engine.overlap
    assert ahead.finished == sync.finished == SMALL_LOOP["loop.requests"]
    assert ahead.tokens == sync.tokens
    assert ahead.generated_tokens == sync.generated_tokens
    assert ahead.decode_tokens == sync.decode_tokens
    assert ahead.prefill_tokens == sync.prefill_tokens
    # requests leave the batch when their last token is launched: the same batches, step
    # for step (what makes GPU bf16 tokens equal too), the last one read after the loop
    assert ahead.loop_steps == sync.loop_steps
    assert ahead.steps_by_mode == sync.steps_by_mode
    assert all(r.in_flight == 0 for r in engine.scheduler.running)
    assert not engine.scheduler.running


def test_debug_mode_runs_the_race_checks_one_step_ahead():
    engine, result = _run(True, **{"loop.chunk_tokens": 4, "planner.debug": True})
    _, sync = _run(False, **{"loop.chunk_tokens": 4})
    assert result.tokens == sync.tokens
    assert engine.planner.stats.verified > 0


def test_a_token_read_on_the_device_before_its_sampling_is_caught(monkeypatch):
    """The step-ahead race: step N+1's decode rows read their ids from the device before
    step N's sampling wrote them (a missing stream dependency). Held back here by skipping
    the write: debug mode names the forward, the row and the request."""
    real = TokenIds.sampled
    calls = []

    def late(self, rows, tokens):
        calls.append(1)
        if len(calls) > 2:  # from the third forward on, the sampled tokens never land
            return
        real(self, rows, tokens)

    monkeypatch.setattr(TokenIds, "sampled", late)
    with pytest.raises(ReplayError, match=r"forward \d+ .* fed row \d+ \(request \d+") as info:
        _run(True, **{"planner.debug": True})
    assert info.value.field == "input_ids"


def test_an_old_slot_written_after_its_step_was_sent_is_refused():
    """Running ahead, an engine must take each step's slot anew: a write into the slot a
    replay already sent would race its transfer, and names the slot and the step."""
    engine = tiny_engine({**SMALL_LOOP, "loop.overlap": True}, share_model=True)
    engine.runner.capture()
    planner = engine.planner
    old = planner.step_inputs(ForwardMode.DECODE)
    engine.scheduler.arrive(engine.workload()[:1])
    engine.scheduler.admit(1)
    request = engine.scheduler.running[0]
    request.fed = len(request.prompt)  # as if prefilled (its KV is not read for this test)
    batch, ids = engine.scheduler.build([request], ForwardMode.DECODE, 1, inputs=old)
    engine.runner.step(batch, {"input_ids": ids})
    with pytest.raises(
        ReplayError, match=r"decode staging slot \d+ was written after step \d+ sent"
    ):
        old.write([5], 1, [request.pool_idx], [0], [4])
    fresh = planner.step_inputs(ForwardMode.DECODE)
    assert fresh is not old
    fresh.write([5], 1, [request.pool_idx], [0], [4])  # the step's own slot takes it


def test_a_step_read_is_taken_once():
    engine = tiny_engine(SMALL_LOOP, share_model=True)
    read = engine.planner.read_later(torch.arange(3))
    assert read.ready()
    assert read.get() == [0, 1, 2]
    with pytest.raises(ReplayError, match="already taken") as info:
        read.get()
    assert info.value.field == "read"


def test_decode_rows_take_their_token_from_the_device():
    ids = TokenIds(4, torch.device("cpu"))
    ids.sampled(torch.tensor([2, 0], dtype=torch.int32), torch.tensor([70, 90]))
    sent = ids.send([5, last_of(2), 6, last_of(0)])
    assert sent.tolist() == [5, last_of(2), 6, last_of(0)]  # one copy, as the host knows them
    assert ids.resolve(sent).tolist() == [5, 70, 6, 90]
    assert ids.resolve(ids.send([1, 2])).tolist() == [1, 2]
    assert ids.resolve(ids.send([])).tolist() == []


def test_verify_rows_take_their_drafts_from_the_device():
    """Every ``draft_of`` id resolves to what ``drafted`` kept for that row and draft, never
    to another row's or to a last sampled token (their ids do not meet), and a table holds
    no more drafts than it was made for."""
    rows, drafts = 5, 3
    ids = TokenIds(rows, torch.device("cpu"), drafts)
    ids.sampled(torch.tensor([1, 4]), torch.tensor([11, 44]))
    ids.drafted(torch.tensor([4, 1]), torch.tensor([[40, 41, 42], [10, 12, 13]]))
    ids.drafted(torch.tensor([2]), torch.tensor([[20]]))  # fewer drafts: the first only
    want = {(4, 0): 40, (4, 1): 41, (4, 2): 42, (1, 0): 10, (1, 1): 12, (1, 2): 13, (2, 0): 20}
    refs = [ids.draft_of(row, i) for row, i in want]
    lasts = [last_of(row) for row in range(rows)]
    assert len(set(refs + lasts)) == len(refs) + len(lasts)
    assert max(refs) < min(lasts)
    sent = ids.send([7, last_of(4), *refs])
    assert ids.resolve(sent).tolist() == [7, 44, *want.values()]
    with pytest.raises(ValueError, match="holds 3 drafts"):
        ids.draft_of(0, drafts)


def _prefill_outputs(requests: int, keep_logits: bool):
    """The engine's outputs of one extend step over the whole prompts of its first
    ``requests`` requests, and the pool rows of those requests."""
    engine = tiny_engine({**SMALL_LOOP, "loop.overlap": True}, share_model=True)
    engine.keep_logits = keep_logits
    sched = engine.scheduler
    sched.arrive(engine.workload()[:requests])
    sched.admit(1)
    work = [(request, len(request.prompt)) for request in sched.running]
    batch, ids = sched.build_extend(work, ForwardMode.EXTEND)
    out = engine.runner.step(batch, {"input_ids": ids})
    return engine, out, [request.pool_idx for request, _ in work]


def test_a_step_samples_and_keeps_its_tokens_inside_its_forward():
    """The forward a graph captures resolves the ids, samples, and keeps each request's token
    by pool row: nothing of the step's device work is left to launch beside its graph."""
    engine, out, rows = _prefill_outputs(2, keep_logits=True)
    assert set(out) >= {"logits", "tokens", "input_ids"}
    assert out["tokens"].tolist() == out["logits"].argmax(dim=-1).tolist()
    assert engine.scheduler.token_ids.last[rows].tolist() == out["tokens"].tolist()


def test_overlap_is_on_by_default_on_cuda_only_and_off_with_speculation():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_overlap("auto", cuda, False)[0]
    assert not resolve_overlap("auto", cpu, False)[0]
    assert resolve_overlap(True, cpu, False)[0]
    assert not resolve_overlap("auto", cuda, True)[0]
    with pytest.raises(ConfigError, match="synchronous loop") as info:
        resolve_overlap(True, cuda, True)
    assert info.value.field == "loop.overlap"


@pytest.mark.parametrize("ragged", [False, True])
def test_an_eager_step_takes_the_previous_steps_tokens_before_it_launches(ragged):
    """An eager forward waits for the device (its plan's check read) and launches kernel by
    kernel: the step before it is taken first, so a prompt's first token is not a step late.
    A step that replays a token bucket is launched first and the previous one taken after."""
    engine = tiny_engine(
        {**SMALL_LOOP, "loop.chunk_tokens": 5, "loop.overlap": True, "graphs.ragged": ragged},
        share_model=True,
    )
    events: list[str] = []
    step, take, extend = engine.step, engine._take, engine._extend_step
    engine.step = lambda result: (events.append("step"), step(result))[1]
    engine._take = lambda launched, result: (events.append("take"), take(launched, result))[1]
    engine._extend_step = lambda *a: (events.append("extend"), extend(*a))[1]
    assert engine.run(progress=False).finished == SMALL_LOOP["loop.requests"]
    steps = " ".join(events).split("step")[2:]  # each loop step's events, past the first
    before = [s.split("extend")[0].split() for s in steps if "extend" in s]
    assert before  # steps with prompt chunks, each after a step with forwards in flight
    assert all(b == (["take"] * len(b) if not ragged else []) and (b or ragged) for b in before)


def test_serving_graphs_keep_no_logits():
    """Serving reads the sampled tokens alone: a graph's outputs are memory of its own in
    every graph, so the logits stay inside the forward (where the pool shares them)."""
    _, out, _ = _prefill_outputs(1, keep_logits=False)
    assert set(out) == {"tokens", "input_ids"}
