"""Dump plans to disk with the library alone, load them back, inspect them and diff them.

A stale buffer or a bad padding row is found by looking at the exact bytes a kernel read,
often on another machine, long after the process is gone. ``planner.dumps`` is the
library's dump API, so an engine built on ``planner`` and ``graphs`` needs nothing else
(this file imports no ``dsv32_engine`` module, and a test holds it to that):
``dump_plans`` writes a plan set (a JSON manifest per backend, the tensors as
safetensors, an index with hashes) atomically; ``load_dump`` reads one back and checks
every byte; ``print_dump`` and ``print_diff`` print what ``python -m planner inspect DIR``
and ``python -m planner diff A B`` print (``inspect_report`` and ``diff_dumps`` give the
same as data); ``planner.debug.diff_plans`` compares two plan sets field by field, live
or loaded.

This dumps a replayed (padded, captured) plan and the eager plan of the same batch padded
to the same size: they must be equal. Then it diffs two batches that differ in one request,
dumped and live. Runs on the CPU in a second or two: ``python examples/dump_plans.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from planner import ForwardBatch, Limits, Planner
from planner.debug import diff_plans
from planner.dumps import diff_dumps, dump_plans, load_dump, print_diff, print_dump

MAX_BATCH, MAX_CONTEXT, PAGE = 4, 64, 16


def decode_batch(table: torch.Tensor, lens: list[int]) -> ForwardBatch:
    """A decode batch of requests 1..len(lens) with those KV lengths."""
    rows = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return ForwardBatch(
        seq_lens_cpu=seq,
        req_pool_indices=rows,
        req_to_token=table,
        out_cache_loc=table[rows.long(), (seq - 1).long()],
    )


def main() -> None:
    table = torch.zeros(MAX_BATCH + 1, MAX_CONTEXT, dtype=torch.int32)
    for row in range(1, MAX_BATCH + 1):
        table[row] = row * MAX_CONTEXT + torch.arange(MAX_CONTEXT, dtype=torch.int32)
    planner = Planner(
        ["paged"], Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, page_size=PAGE)
    )
    batch = decode_batch(table, [20, 7, 33])

    planner.capture(4, req_to_token=table)
    replayed = planner.replay(batch, 4)
    planner.record(4)  # what a graph replay runs: the graph-safe ops (no graph here)
    eager = planner.plan(batch, pad_to=4)  # what a replay of size 4 must equal

    # one request one token longer: what a diff must find
    longer = decode_batch(table, [20, 8, 33])
    other = planner.plan(longer, pad_to=4)

    with tempfile.TemporaryDirectory() as tmp:
        a = dump_plans(replayed, Path(tmp) / "replayed", step=7, batch=batch, label="replayed")
        b = dump_plans(eager, Path(tmp) / "eager", step=7, batch=batch, label="eager")
        print_dump(a)  # the table `python -m planner inspect` prints; loading checks every byte
        dump = load_dump(a)  # every size, hash and checksum checked; raises DumpError if bad
        print(f"dump {a.name}: phase={dump.phase} mode={dump.mode} step={dump.step}")
        print(f"  batch: bs={dump.batch.bs} padded to {dump.batch.padded_reqs}")
        for backend, name, record, tensor in dump.fields():
            head = tensor.reshape(-1)[:4].tolist()  # the loaded tensor itself
            print(f"  {backend}.{name}: {record.dtype}{record.shape} first values {head}")
        print("  scalars:", dump.scalars("paged"))
        print("  page_table row 0:", dump.tensors["paged"]["page_table"][0].tolist())
        if print_diff(a, b):  # replay and eager of one batch: "dumps are equal", nothing returned
            raise SystemExit("a replayed plan differs from the eager plan of its batch")

        c = dump_plans(other, Path(tmp) / "other", step=8, batch=longer, label="longer")
        differs = print_diff(b, c)  # the tables `python -m planner diff` prints, rows named
        print(
            "eager vs other (dumps): differing fields:", [f"{d.backend}.{d.field}" for d in differs]
        )
        as_data = {d.field: d.rows for d in diff_dumps(load_dump(b), load_dump(c)) if d.differs}
        print("  differing rows, as data:", as_data)
        if not as_data:
            raise SystemExit("the diff missed a request one token longer")

    # diff live plan sets, no disk: the same comparison the dumps' diff runs
    for mismatch in diff_plans(eager, other):
        print("  differs:", mismatch.describe())
    print("dump_plans: ok")


if __name__ == "__main__":
    main()
