#!/usr/bin/env python3
"""Planner host time per ragged replay (extend, mixed) beside the decode replay.

Issue 37 asks for at most 50 us median of planner host time per ragged step. This measures
``planner.replay(batch, bs, tokens=T)`` alone, for the ``nsa`` backend, with no device sync
and no graph launch: what the host spends before a ragged graph can be launched. One
planner captures decode at ``--max-batch`` and the extend and mixed buckets (every request
bucket of ``--req-buckets`` with every token bucket of ``--token-buckets``); each call
replays the smallest bucket holding its batch. Batches change every call the way a serving
loop's do:

- ``decode``: every request one token longer than the call before;
- ``mixed``: a different number of decoding requests (1..``--decoding``), each a token
  longer than the call before, plus one prompt chunk of a different size (``--chunk / 4``
  to ``--chunk`` tokens) continuing the prompt the last call chunked;
- ``extend``: 1 to 4 prompts sharing a chunk budget of ``--chunk`` tokens, each after a
  cached prefix that grows.

The three are interleaved call by call (``benchmarks.common.time_paired``), so the host's
drift falls on each alike. ``--evict MB`` writes that much memory before every timed call,
as the model's step between two replays does: the replay then runs with cold caches, as in
a serving loop (in a tight loop its code and data stay cached, 3-5x faster than there).
Only the public API is used, so the same script measures an
older commit's tree beside this one (``git archive HEAD | tar -x -C /tmp/old``, then run
both alternately).

    python3 -m benchmarks.ragged_replay --out /tmp/ragged_replay.json
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np
import torch

from backends.nsa import NSAPlan  # noqa: F401  (registers the NSA backend)
from benchmarks.common import machine, num_sms_of, print_table, time_paired, write_json
from benchmarks.seed_stack import make_table
from planner import ForwardBatch, ForwardMode, Limits, Planner

I32 = torch.int32


def ragged_batch(
    table: torch.Tensor,
    mode: ForwardMode,
    pools: list[int],
    lens: list[int],
    new: list[int],
) -> ForwardBatch:
    """Requests ``pools`` at KV lengths ``lens``, each adding its last ``new`` tokens; slots
    and positions as an engine hands them over (a decode batch leaves its lengths out)."""
    positions = [q for n, e in zip(lens, new) for q in range(n - e, n)]
    rows = [p for p, e in zip(pools, new) for _ in range(e)]
    loc = table[torch.tensor(rows).long(), torch.tensor(positions).long()]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=I32),
        req_pool_indices=torch.tensor(pools, dtype=I32),
        req_to_token=table,
        out_cache_loc=loc.to(I32),
        positions=torch.tensor(positions, dtype=I32),
        mode=mode,
        extend_lens_cpu=None if mode is ForwardMode.DECODE else torch.tensor(new, dtype=I32),
    )


class Serving:
    """Batches of a serving loop, one per call: lengths grow, requests come and go."""

    def __init__(self, table: torch.Tensor, args: argparse.Namespace) -> None:
        self.table, self.args = table, args
        self.rng = random.Random(args.seed)
        ctx = args.context
        self.lens = [self.rng.randint(ctx // 4, ctx // 2) for _ in range(args.max_batch)]
        self.prefix = 0

    def decode(self, i: int) -> ForwardBatch:
        bs = self.args.max_batch
        lens = [min(n + i, self.args.context) for n in self.lens[:bs]]
        return ragged_batch(self.table, ForwardMode.DECODE, list(range(1, bs + 1)), lens, [1] * bs)

    def _chunk(self, size: int) -> int:
        """The next chunk of a prompt: its cached prefix grows, a new prompt starts at 0."""
        if self.prefix + size > self.args.context:
            self.prefix = 0
        self.prefix += size
        return self.prefix

    def mixed(self, i: int) -> ForwardBatch:
        args, rng = self.args, self.rng
        decoding = rng.randint(1, args.decoding)
        chunk = rng.randint(max(1, args.chunk // 4), args.chunk)
        lens = [min(n + i, args.context) for n in self.lens[:decoding]]
        lens.append(self._chunk(chunk))
        pools = list(range(1, decoding + 2))
        return ragged_batch(self.table, ForwardMode.MIXED, pools, lens, [1] * decoding + [chunk])

    def extend(self, i: int) -> ForwardBatch:
        args, rng = self.args, self.rng
        prompts = rng.randint(1, 4)
        budget = rng.randint(prompts, args.chunk)
        cuts = sorted(rng.sample(range(1, budget), prompts - 1)) if prompts > 1 else []
        new = [b - a for a, b in zip([0, *cuts], [*cuts, budget])]
        first = rng.randint(1, args.max_batch - prompts)  # different requests each call
        lens = [min(rng.randint(0, args.context // 2) + e, args.context) for e in new]
        pools = list(range(first + 1, first + prompts + 1))
        return ragged_batch(self.table, ForwardMode.EXTEND, pools, lens, new)


def bucket_of(batch: ForwardBatch, reqs: list[int], tokens: list[int]) -> tuple[int, int]:
    """The smallest captured bucket holding ``batch`` (fewest tokens, then fewest requests)."""
    n = batch.num_tokens
    return min(t for t in tokens if t >= n), min(b for b in reqs if b >= batch.bs)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    table, num_pages = make_table(args.max_batch, args.context, device, args.seed)
    limits = Limits(
        max_batch=args.max_batch,
        max_context=args.context,
        page_size=64,
        num_sms=num_sms_of(device),
        max_tokens=max(args.token_buckets),
        kv_slots=num_pages * 64,
        device=str(device),
    )
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
    planner.capture(args.max_batch, ForwardMode.DECODE, req_to_token=table)
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        for bs in args.req_buckets:
            for tokens in args.token_buckets:
                planner.capture(bs, mode, req_to_token=table, tokens=tokens)
    serving = Serving(table.cpu() if device.type == "cpu" else table, args)
    calls = args.warmup + args.iters
    # every batch made before the clock starts: only the replay is timed
    made = {
        "decode": [serving.decode(i) for i in range(calls)],
        "mixed": [serving.mixed(i) for i in range(calls)],
        "extend": [serving.extend(i) for i in range(calls)],
    }
    buckets = {
        name: [bucket_of(b, args.req_buckets, args.token_buckets) for b in made[name]]
        for name in ("mixed", "extend")
    }
    bs = args.max_batch

    def ragged(name: str):
        batches, at = made[name], buckets[name]
        return lambda i: planner.replay(batches[i], at[i][1], tokens=at[i][0])

    variants = {
        "decode": lambda i: planner.replay(made["decode"][i], bs),
        "mixed": ragged("mixed"),
        "extend": ragged("extend"),
    }
    between = None
    if args.evict:
        evict = np.zeros(args.evict << 18, dtype=np.int32)  # MB of int32

        def between() -> None:
            np.add(evict, 1, out=evict)  # every cache line written: what a step leaves behind

    timed = time_paired(variants, warmup=args.warmup, iters=args.iters, between=between)
    tokens = {name: sorted(b.num_tokens for b in made[name][args.warmup :]) for name in made}
    return {"timed": timed, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="planner host time per ragged replay (nsa extend, mixed) beside decode"
    )
    p.add_argument("--max-batch", type=int, default=64, help="requests (decode bucket, pool)")
    p.add_argument("--context", type=int, default=4096, help="max_context")
    p.add_argument("--chunk", type=int, default=256, help="largest prompt chunk per step")
    p.add_argument("--decoding", type=int, default=48, help="most decoding requests a mixed step")
    p.add_argument(
        "--req-buckets", type=int, nargs="+", default=[16, 64], help="ragged request buckets"
    )
    p.add_argument(
        "--token-buckets", type=int, nargs="+", default=[64, 128, 256, 512], help="token buckets"
    )
    p.add_argument("--warmup", type=int, default=200, help="untimed calls first")
    p.add_argument("--iters", type=int, default=2000, help="timed calls of each replay")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches")
    p.add_argument(
        "--evict", type=int, default=0, metavar="MB", help="write MB of memory before each call"
    )
    p.add_argument("--device", default="cpu", help="the planner's device (cpu or cuda)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.decoding + 1 > max(args.req_buckets) or args.chunk + args.decoding > max(
        args.token_buckets
    ):
        p.error("--decoding/--chunk: a mixed step must fit the largest bucket")
    result = measure(args)
    timed, tokens = result["timed"], result["tokens"]
    table = print_table(
        f"planner host time per replay, us (nsa, max_batch {args.max_batch}, context "
        f"{args.context}, {args.iters} calls after {args.warmup}, interleaved"
        f"{f', {args.evict} MB written before each' if args.evict else ''})",
        ("replay", "median", "p99", "p90", "tokens median", "tokens max"),
        [
            (
                name,
                f"{s['median_us']:.1f}",
                f"{s['p99_us']:.1f}",
                f"{s['p90_us']:.1f}",
                tokens[name][len(tokens[name]) // 2],
                tokens[name][-1],
            )
            for name, s in timed.items()
        ],
    )
    write_json(args.out, {"machine": machine(), "args": vars(args), **result, "table": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
