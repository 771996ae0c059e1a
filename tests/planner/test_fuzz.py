"""Fuzzing the three phases: random batch sequences, replay == eager, bit for bit.

One planner plans both the NSA (DeepSeek-V3.2) and the paged backend. Every few
sequences a new planner is built with a random capture-size set, ``num_sms`` and
``ops_in_graph``, and captures decode and verify at each size. Each sequence is a
handful of random batches (edge lengths at page and schedule-split boundaries, int32 or
int64 inputs, positions and device lengths given or not) in random modes. Each batch
replays on the smallest captured size that holds it (with ``record`` run after
``replay``, as a graph replay does) or, beyond the largest size, plans eagerly, and
every replayed plan set must

- be the captured object itself, every tensor at its captured address;
- equal ``plan(batch, pad_to=size)`` bit for bit, scalars included;
- hold the schemas' pad values in every padding row;
- agree with the unpadded eager plan on every real row (and hold 0 past the batch's
  own width where the static plan is wider).

Default suite: 300 sequences. ``pytest -m slow tests/test_fuzz.py``: 10,000.
A failure names the seed, sequence and step to replay it with :func:`run_fuzz`.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from planner.debug import diff_plans, padding_violations
from planner.schema import parse_dim
from tests.support.batches import make_pool

PAGE, MAX_CTX, MAX_BATCH, NEXT_N = 64, 320, 12, 2
POOL = 2 * MAX_BATCH + 1
TABLE = make_pool(POOL, MAX_CTX, PAGE, seed=7)
KV_SLOTS = int(TABLE.max()) + 1
DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
EDGES = (1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 256, 257, MAX_CTX - 1, MAX_CTX)
"""Lengths where pages (64) and deep_gemm schedule splits (256) begin and end."""
SEQUENCES_PER_PLANNER = 20


@dataclass
class FuzzStats:
    sequences: int = 0
    planners: int = 0
    batches: Counter = field(default_factory=Counter)
    sizes: Counter = field(default_factory=Counter)
    checks: int = 0


def random_sizes(rng: random.Random) -> list[int]:
    """A random, strictly ascending capture-size set; it need not reach MAX_BATCH."""
    k = rng.randint(1, 6)
    return sorted(rng.sample(range(1, MAX_BATCH + 1), k))


def fuzz_batch(rng: random.Random, mode: ForwardMode, bs: int) -> ForwardBatch:
    """A valid batch with edge-biased lengths and randomly typed optional inputs."""
    n = NEXT_N if mode is VERIFY else 1
    reqs = rng.sample(range(1, POOL), bs)
    lens = [
        max(n, rng.choice(EDGES)) if rng.random() < 0.4 else rng.randint(n, MAX_CTX)
        for _ in range(bs)
    ]
    cols = [[length - n + i for i in range(n)] for length in lens]
    locs = [int(TABLE[r, c]) for r, row in zip(reqs, cols) for c in row]
    positions = [c for row in cols for c in row]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=rng.choice([torch.int32, torch.int64]))

    seq = torch.tensor(lens, dtype=torch.int32)
    return ForwardBatch(
        seq_lens_cpu=seq,
        req_pool_indices=index(reqs),
        req_to_token=TABLE,
        out_cache_loc=index(locs),
        positions=index(positions) if rng.random() < 0.5 else None,
        seq_lens=seq.clone() if rng.random() < 0.3 else None,
        mode=mode,
        next_n=n,
    )


class Fuzzer:
    """Builds planners, runs sequences, and checks every replay; see the module docstring."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.stats = FuzzStats()
        self.planner: Planner | None = None
        self.sizes: list[int] = []
        self.captured: dict[tuple[ForwardMode, int], tuple[PlanSet, list[int]]] = {}
        self.after_replay = None  # tests: damage a replayed plan to prove the checks bite

    def new_planner(self) -> None:
        rng = self.rng
        limits = Limits(
            max_batch=MAX_BATCH,
            max_context=MAX_CTX,
            page_size=PAGE,
            next_n=NEXT_N,
            num_sms=rng.choice([1, 3, 8, 132]),
            kv_slots=KV_SLOTS,
        )
        self.planner = Planner(["nsa", "paged"], limits, ops_in_graph=rng.random() < 0.5)
        self.sizes = random_sizes(rng)
        self.captured = {}
        for mode in (DECODE, VERIFY):
            for bs in self.sizes:
                plans = self.planner.capture(bs, mode, req_to_token=TABLE)
                self.captured[(mode, bs)] = (plans, _pointers(plans))
        self.stats.planners += 1

    def run(self, sequences: int) -> FuzzStats:
        for i in range(sequences):
            if i % SEQUENCES_PER_PLANNER == 0:
                self.new_planner()
            for step in range(self.rng.randint(1, 6)):
                mode = self.rng.choice([DECODE, VERIFY])
                batch = fuzz_batch(self.rng, mode, self.rng.randint(1, MAX_BATCH))
                where = (
                    f"seed {self.seed}, sequence {i}, step {step}: {mode.value} bs={batch.bs} "
                    f"lens={batch.seq_lens_cpu.tolist()} sizes={self.sizes} "
                    f"ops_in_graph={self.planner.ops_in_graph} "
                    f"num_sms={self.planner.limits.num_sms}"
                )
                self.check(batch, where)
            self.stats.sequences += 1
        return self.stats

    def check(self, batch: ForwardBatch, where: str) -> None:
        planner, mode = self.planner, ForwardMode(batch.mode)
        size = next((s for s in self.sizes if s >= batch.bs), None)
        if size is None:  # beyond the largest graph: the runner plans eagerly
            plain = planner.plan(batch)
            _assert_rows_agree(planner.plan(batch, pad_to=batch.bs), plain, batch, where)
            self.stats.batches["eager"] += 1
            return
        plans = planner.replay(batch, size)
        if planner.ops_in_graph:
            planner.record(size, mode)  # what graph.replay() runs before the layers
        if self.after_replay is not None:
            self.after_replay(plans)
        captured, pointers = self.captured[(mode, size)]
        assert plans is captured, f"replay returned other plan objects ({where})"
        assert _pointers(plans) == pointers, f"a plan tensor moved since capture ({where})"
        assert (plans.phase, plans.reqs, plans.real_reqs) == ("replay", size, batch.bs), where
        mismatches = diff_plans(plans, planner.plan(batch, pad_to=size))
        assert not mismatches, f"replay != padded eager ({where}): " + "; ".join(
            m.describe() for m in mismatches
        )
        n = planner.program(mode).next_n
        bad = padding_violations(
            plans, planner.program(mode).pads, {"reqs": batch.bs, "rows": batch.bs * n}
        )
        assert not bad, f"padding rows hold wrong values in {bad} ({where})"
        _assert_rows_agree(plans, planner.plan(batch), batch, where)
        self.stats.batches[f"replay/{mode.value}"] += 1
        self.stats.sizes[size] += 1
        self.stats.checks += 4


def _pointers(plans: PlanSet) -> list[int]:
    return [t.data_ptr() for plan in plans.values() for t in plan.tensors().values()]


def _assert_rows_agree(wide: PlanSet, plain: PlanSet, batch: ForwardBatch, where: str) -> None:
    """Real rows of a padded / static-width plan equal the unpadded eager plan.

    Where the static plan is wider (``max_len`` / ``pages`` sized for max_context),
    the extra columns of real rows must hold 0, the null slot and page.
    """
    real = {"reqs": batch.bs, "rows": batch.bs * batch.next_n}
    for backend, plan in plain.items():
        other = wide[backend]
        for name, spec in plan.tensor_specs.items():
            dim, offset = parse_dim(spec.shape[0])
            if dim not in real:
                continue  # the schedule: one per batch, padding requests change it
            n = real[dim] + offset
            got, want = getattr(other, name)[:n], getattr(plan, name)
            assert want.shape[0] == n, f"{backend}.{name}: eager has {want.shape[0]} rows ({where})"
            if got.dim() == 2 and got.shape[1] != want.shape[1]:
                extra = got[:, want.shape[1] :]
                assert not extra.any(), f"{backend}.{name}: non-zero past the width ({where})"
                got = got[:, : want.shape[1]]
            assert torch.equal(got, want), f"{backend}.{name}: real rows differ ({where})"


def _assert_coverage(stats: FuzzStats, sequences: int) -> None:
    assert stats.sequences == sequences
    assert stats.batches["replay/decode"] and stats.batches["replay/target_verify"]
    assert stats.batches["eager"], "no batch went past the largest captured size"
    assert len(stats.sizes) >= 8, f"too few distinct replay sizes: {sorted(stats.sizes)}"


def test_fuzz_replay_equals_eager_300_sequences():
    stats = Fuzzer(seed=1).run(300)
    _assert_coverage(stats, 300)


@pytest.mark.slow
def test_fuzz_replay_equals_eager_10000_sequences():
    stats = Fuzzer(seed=2).run(10_000)
    _assert_coverage(stats, 10_000)
    assert stats.planners == 10_000 // SEQUENCES_PER_PLANNER
    assert len(stats.sizes) == MAX_BATCH


@pytest.mark.parametrize(
    ("field", "row"), [("nsa.page_table", "real"), ("paged.seq_lens", "padding")]
)
def test_fuzzer_catches_a_stale_field(field, row):
    """The checks are not vacuous: one stale element in a real or a padding row is caught."""
    fuzzer = Fuzzer(seed=3)
    fuzzer.new_planner()
    backend, name = field.split(".")

    def stale(plans: PlanSet) -> None:
        tensor = getattr(plans[backend], name)
        i = 0 if row == "real" else plans.real_reqs
        if i < tensor.shape[0]:
            tensor[i].add_(1)  # what a refresh that skipped this row leaves behind

    fuzzer.after_replay = stale
    with pytest.raises(AssertionError, match=name):
        for _ in range(50):
            fuzzer.check(fuzz_batch(fuzzer.rng, DECODE, fuzzer.rng.randint(1, MAX_BATCH)), "")
