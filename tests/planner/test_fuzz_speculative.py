"""Fuzzing the speculative modes: random sequences of verify (1-8 tokens), draft-extend (random
accept lengths) and draft-decode (1-7 steps) batches, with decode batches between them.

Every few sequences a new planner (NSA and paged) is built with a random ``next_n``,
number of draft steps, capture-size set, ``num_sms`` and ``ops_in_graph``, and captures
every mode at each size. Each batch replays on the smallest captured size that holds it
(``record`` after ``replay``, as a graph replay runs it) or, past the largest, plans
eagerly, and every replayed plan set must

- be the captured object itself, every tensor at its captured address;
- equal ``plan(batch, pad_to=size)`` bit for bit (every step of a draft decode);
- hold the schemas' pad values in every padding row: padding requests' rows, and the rows
  of a draft extend past a request's accepted tokens;
- agree with the unpadded eager plan on every real row.

Default suite: 160 sequences; ``-m slow``: 4,000. A failure names the seed, sequence and
step.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from planner.debug import diff_plans, padding_violations
from planner.schema import parse_dim
from tests.support.batches import make_pool
from tests.support.spec_batches import draft_decode_batch, draft_extend_batch, verify_batch

PAGE, MAX_CTX, MAX_BATCH = 64, 300, 6
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=11)
KV_SLOTS = int(TABLE.max()) + 1
VERIFY, EXTEND = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND
DECODE, DRAFT_DECODE = ForwardMode.DECODE, ForwardMode.DRAFT_DECODE
MODES = (DECODE, VERIFY, EXTEND, DRAFT_DECODE)
EDGES = (1, 2, 8, 63, 64, 65, 255, 256, 257, MAX_CTX)
PER_PLANNER = 10


def _pointers(plans: PlanSet) -> list[int]:
    return [t.data_ptr() for plan in plans.values() for t in plan.tensors().values()]


class SpecFuzzer:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.after_replay = None  # tests: damage a replayed plan to prove the checks bite

    def new_planner(self) -> None:
        rng = self.rng
        self.next_n, self.steps = rng.randint(1, 8), rng.randint(1, 7)
        limits = Limits(
            max_batch=MAX_BATCH,
            max_context=MAX_CTX,
            page_size=PAGE,
            next_n=self.next_n,
            draft_steps=self.steps,
            num_sms=rng.choice([1, 5, 132]),
            kv_slots=KV_SLOTS,
        )
        self.planner = Planner(["nsa", "paged"], limits, ops_in_graph=rng.random() < 0.5)
        self.sizes = sorted(rng.sample(range(1, MAX_BATCH + 1), rng.randint(1, 4)))
        self.captured = {}
        for mode in MODES:
            for bs in self.sizes:
                plans = self.planner.capture(bs, mode, req_to_token=TABLE)
                self.captured[(mode, bs)] = (plans, _pointers(plans))

    def _length(self, low: int) -> int:
        rng = self.rng
        return max(low, rng.choice(EDGES)) if rng.random() < 0.4 else rng.randint(low, MAX_CTX)

    def batch(self, mode: ForwardMode) -> ForwardBatch:
        rng, bs = self.rng, self.rng.randint(1, MAX_BATCH)
        if mode is EXTEND:
            accepted = [rng.randint(1, self.next_n) for _ in range(bs)]
            lens = [self._length(a) for a in accepted]
            return draft_extend_batch(
                rng,
                TABLE,
                bs=bs,
                max_context=MAX_CTX,
                next_n=self.next_n,
                accepted=accepted,
                lens=lens,
                typed=True,
            )
        n = {DECODE: 1, VERIFY: self.next_n, DRAFT_DECODE: self.steps}[mode]
        lens = [self._length(n) for _ in range(bs)]
        if mode is DRAFT_DECODE:
            return draft_decode_batch(
                rng, TABLE, bs=bs, max_context=MAX_CTX, steps=n, lens=lens, typed=True
            )
        batch = verify_batch(
            rng, TABLE, bs=bs, max_context=MAX_CTX, next_n=n, lens=lens, typed=True
        )
        return replace(batch, mode=mode)

    def run(self, sequences: int) -> Counter:
        for i in range(sequences):
            if i % PER_PLANNER == 0:
                self.new_planner()
            for step in range(self.rng.randint(2, 6)):
                mode = self.rng.choice(MODES)
                batch = self.batch(mode)
                where = (
                    f"seed {self.seed}, sequence {i}, step {step}: {mode.value} bs={batch.bs} "
                    f"next_n={self.next_n} steps={self.steps} lens={batch.seq_lens_cpu.tolist()} "
                    f"accepted={None if batch.extend_lens_cpu is None else batch.extend_lens_cpu.tolist()} "
                    f"sizes={self.sizes} ops_in_graph={self.planner.ops_in_graph}"
                )
                self.check(batch, where)
        return self.counts

    def check(self, batch: ForwardBatch, where: str) -> None:
        planner, mode = self.planner, ForwardMode(batch.mode)
        size = next((s for s in self.sizes if s >= batch.bs), None)
        if size is None:
            _assert_rows_agree(
                planner.plan(batch, pad_to=batch.bs), planner.plan(batch), planner, batch, where
            )
            self.counts["eager"] += 1
            return
        plans = planner.replay(batch, size)
        if planner.ops_in_graph:
            planner.record(size, mode)
        if self.after_replay is not None:
            self.after_replay(plans)
        captured, pointers = self.captured[(mode, size)]
        assert plans is captured and _pointers(plans) == pointers, where
        mismatches = diff_plans(plans, planner.plan(batch, pad_to=size))
        assert not mismatches, f"replay != eager ({where}): " + "; ".join(
            m.describe() for m in mismatches
        )
        real = planner.real_rows(mode, batch)
        bad = padding_violations(plans, planner.program(mode).pads, real)
        assert not bad, f"padding rows hold wrong values in {bad} ({where})"
        _assert_rows_agree(plans, planner.plan(batch), planner, batch, where)
        self.counts[f"replay/{mode.value}"] += 1


def _assert_rows_agree(
    wide: PlanSet, plain: PlanSet, planner: Planner, batch: ForwardBatch, where: str
) -> None:
    """Real rows of a padded, static-width plan equal the unpadded eager plan's; where the
    static plan is wider, the extra columns of real rows hold 0 (the null slot and page)."""
    real = planner.real_rows(batch.mode, batch)
    for key, plan in plain.items():
        other = wide[key]
        for name, spec in plan.tensor_specs.items():
            dim, offset = parse_dim(spec.shape[0])
            if dim not in real:
                continue  # the schedule: padding requests change it
            n = real[dim] + offset
            got, want = getattr(other, name)[:n], getattr(plan, name)[:n]
            if got.dim() == 2 and got.shape[1] != want.shape[1]:
                assert not got[:, want.shape[1] :].any(), f"{key}.{name} past the width ({where})"
                got = got[:, : want.shape[1]]
            assert torch.equal(got, want), f"{key}.{name}: real rows differ ({where})"


def _assert_coverage(counts: Counter) -> None:
    for mode in MODES:
        assert counts[f"replay/{mode.value}"], f"no {mode.value} batch replayed"
    assert counts["eager"], "no batch went past the largest captured size"


def test_fuzz_speculative_replay_equals_eager_160_sequences():
    _assert_coverage(SpecFuzzer(seed=1).run(160))


@pytest.mark.slow
def test_fuzz_speculative_replay_equals_eager_4000_sequences():
    _assert_coverage(SpecFuzzer(seed=2).run(4000))


def test_spec_fuzzer_catches_a_stale_padding_row():
    """The checks are not vacuous: a padding row of a draft extend left stale is caught."""
    fuzzer = SpecFuzzer(seed=3)
    fuzzer.new_planner()
    while fuzzer.next_n < 2:
        fuzzer.new_planner()
    batch = draft_extend_batch(
        fuzzer.rng, TABLE, bs=1, max_context=MAX_CTX, next_n=fuzzer.next_n, accepted=[1]
    )

    def stale(plans: PlanSet) -> None:
        plans["nsa"].positions[1] = 5  # row 1 is past the one accepted token

    fuzzer.after_replay = stale
    with pytest.raises(AssertionError, match="positions"):
        fuzzer.check(batch, "stale")
