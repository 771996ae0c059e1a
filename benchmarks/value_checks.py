"""What the door's relation checks cost on the host: duplicates, positions, the token table.

``planner/checks.py`` refuses a KV slot written twice, a request twice in a batch and
positions that disagree with the lengths on every batch (replay included), and token table
entries outside ``[0, kv_slots)`` in eager ``plan()`` and debug mode. This measures each
check alone at decode batch sizes, and a CPU ``Planner.replay`` (NSA + paged) with the
relation checks and with them stubbed out.

    python benchmarks/value_checks.py [--sizes 1 8 64 256 1024] [--repeats 2000]

Prints microseconds per call: the median of ``--rounds`` rounds of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import ForwardBatch, Limits, Planner  # noqa: E402
from planner.checks import check_positions, check_table_entries, check_unique  # noqa: E402
from planner.staging import StagingLayout  # noqa: E402

PAGE = 64


def _timed(fn, repeats: int, rounds: int) -> float:
    """Median over rounds of the mean microseconds per call."""
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        per_round.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(per_round)


def _batch(bs: int, context: int, table: torch.Tensor, rng: random.Random) -> ForwardBatch:
    pools = rng.sample(range(1, table.shape[0]), bs)
    lens = [rng.randint(1, context) for _ in range(bs)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(pools, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor(
            [int(table[p, n - 1]) for p, n in zip(pools, lens)], dtype=torch.int32
        ),
        positions=torch.tensor([n - 1 for n in lens], dtype=torch.int32),
    )


def _table(rows: int, context: int) -> torch.Tensor:
    pages = -(-context // PAGE)
    ids = torch.randperm(rows * pages, generator=torch.Generator().manual_seed(0)) + 1
    slots = ids.view(rows, pages, 1) * PAGE + torch.arange(PAGE).view(1, 1, PAGE)
    table = slots.reshape(rows, -1)[:, :context].to(torch.int32).contiguous()
    table[0] = 0
    return table


def measure(bs: int, repeats: int, rounds: int, context: int = 2048) -> dict[str, float]:
    rng = random.Random(bs)
    table = _table(bs + 1, context)
    batch = _batch(bs, context, table, rng)
    slots = batch.out_cache_loc.numpy()
    pools = batch.req_pool_indices.numpy()
    lens = batch.seq_lens_cpu.numpy()
    positions = batch.positions.numpy()
    kv_slots = int(table.max()) + 1
    row = {
        "bs": bs,
        "out_cache_loc_unique_us": _timed(
            lambda: check_unique("out_cache_loc", slots, "x"), repeats, rounds
        ),
        "req_pool_indices_unique_us": _timed(
            lambda: check_unique("req_pool_indices", pools, "x"), repeats, rounds
        ),
        "positions_us": _timed(lambda: check_positions(positions, lens, None), repeats, rounds),
        "table_entries_us (eager/debug only)": _timed(
            lambda: check_table_entries(table, pools, lens, kv_slots),
            max(1, repeats // 10),
            rounds,
        ),
    }
    limits = Limits(max_batch=bs, max_context=context, kv_slots=kv_slots)
    planner = Planner(["nsa", "paged"], limits)
    planner.capture(bs, req_to_token=table)
    with_checks = _timed(lambda: planner.replay(batch, bs), max(1, repeats // 10), rounds)
    relations = StagingLayout._check_relations
    StagingLayout._check_relations = lambda *a, **k: None
    try:
        without = _timed(lambda: planner.replay(batch, bs), max(1, repeats // 10), rounds)
    finally:
        StagingLayout._check_relations = relations
    row["replay_us"] = with_checks
    row["replay_without_relation_checks_us"] = without
    return row


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(bs, args.repeats, args.rounds) for bs in args.sizes]
    for row in rows:
        print(
            "  ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
