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

Beside the mixed replay the table has two floor rows, timed on the same mixed batches in the
same interleaved run, so the planner's number is read against what no replay can go below
(measured next to it, on the same host at the same moment):

- ``floor``: the batch's five host inputs written into one preallocated int32 host buffer
  (pinned on CUDA) and its used prefix copied to the device in one copy: no checks, no
  padding, no planner. A pure-Python replay cannot do less.
- ``floor+checks``: the floor plus the fewest numpy checks that refuse bad input (the range
  of each input, a repeated slot, positions that do not continue each request's KV).

The five are interleaved call by call (``benchmarks.common.time_paired``), so the host's
drift falls on each alike. ``--evict MB`` writes that much memory before every timed call,
as the model's step between two replays does: the replay then runs with cold caches, as in
a serving loop (in a tight loop its code and data stay cached, 3-5x faster than there).
Only the public API is used, so the same script measures an
older commit's tree beside this one (``git archive HEAD | tar -x -C /tmp/old``, then run
both alternately).

    python3 -m benchmarks ragged_replay --out /tmp/ragged_replay.json
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.nsa import NSAPlan  # noqa: F401  (registers the NSA backend)
from benchmarks.common import machine, num_sms_of, print_table, time_paired, write_json
from benchmarks.kernels.seed_stack import make_table
from planner import ForwardBatch, ForwardMode, Limits, Planner

GPU_STEPS = {
    "": "--out {out}/ragged_replay.json",
}

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


Inputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | torch.Tensor, np.ndarray]
"""A ragged batch's five int32 inputs: lengths, extend lengths, pool rows, slots, positions;
the slots stay a device tensor where the engine hands them over on the device."""


def batch_inputs(batch: ForwardBatch) -> Inputs:
    """The five inputs, host ones as numpy views (no copy). A ragged batch has all five
    (no None test here: the floor checks nothing)."""
    slots = batch.out_cache_loc
    return (
        batch.seq_lens_cpu.numpy(),
        batch.extend_lens_cpu.numpy(),  # type: ignore[union-attr]
        batch.req_pool_indices.numpy(),
        slots if slots.is_cuda else slots.numpy(),
        batch.positions.numpy(),  # type: ignore[union-attr]
    )


class Staging:
    """One preallocated int32 host buffer (pinned on CUDA, its numpy view taken once) and its
    device twin: the least host work any replay must do is write its host inputs here, copy
    the used prefix over in one copy, and copy a device-resident input after it on the
    device (as the planner does), so this is the floor a pure-Python replay cannot go
    below."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=I32, pin_memory=self.cuda)
        self.view = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=I32, device=device)

    def stage(self, inputs: Inputs) -> int:
        """Write the host ``inputs`` into consecutive slices, copy the used prefix, then the
        device ones after it; the entries used."""
        view, used, on_device = self.view, 0, []
        for a in inputs:
            if isinstance(a, torch.Tensor):
                on_device.append(a)
                continue
            view[used : used + a.size] = a
            used += a.size
        self.dev[:used].copy_(self.host[:used], non_blocking=self.cuda)
        for t in on_device:
            self.dev[used : used + t.shape[0]].copy_(t)
            used += t.shape[0]
        return used


@dataclass(frozen=True)
class Bounds:
    """Limits a replay refuses input past: slots ``< kv_slots``, pool rows ``< pool_rows``,
    lengths ``1..context``, positions ``< context``."""

    kv_slots: int
    pool_rows: int
    context: int


def _within(a: np.ndarray, lo: int, hi: int, name: str) -> None:
    """Refuse ``a`` unless every value is in ``lo..hi`` (inclusive): one min, one max."""
    if a.min() < lo or a.max() > hi:
        raise ValueError(f"{name} outside {lo}..{hi}")


def check_inputs(inputs: Inputs, bounds: Bounds) -> None:
    """The fewest numpy checks a replay needs to refuse a bad ragged batch (ValueError): each
    input's range, no slot written twice, positions continuing each request's KV (request
    ``r``'s tokens at ``seq_len - extend_len + arange(extend_len)``). Slots on the device
    are not read (a read would wait for the GPU; the planner leaves them to debug mode
    too). The floor plus these is the floor of a replay that validates its input."""
    seq, ext, pools, loc, pos = inputs
    ctx = bounds.context
    _within(seq, 1, ctx, "seq_lens")
    _within(ext, 1, ctx, "extend_lens")
    _within(pools, 0, bounds.pool_rows - 1, "req_pool_indices")
    _within(pos, 0, ctx - 1, "positions")
    ends = np.cumsum(ext)
    if not (seq.size == ext.size == pools.size and loc.shape[0] == pos.size == ends[-1]):
        raise ValueError("sizes disagree: requests or tokens")
    if not isinstance(loc, torch.Tensor):
        _within(loc, 0, bounds.kv_slots - 1, "out_cache_loc")
        ordered = np.sort(loc)
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError("out_cache_loc: a slot repeated")
    # token j of request r sits at seq[r] - ext[r] + (j - start[r]) = (seq[r] - end[r]) + j
    if (np.repeat(seq - ends, ext) + np.arange(pos.size) != pos).any():
        raise ValueError("positions do not continue each request's KV")


def floor_variants(
    batches: Sequence[ForwardBatch], bounds: Bounds, device: torch.device
) -> dict[str, Callable[[int], None]]:
    """``floor`` and ``floor+checks`` of ``batches`` (one call per batch), each staging into
    its own preallocated buffers, sized for the largest batch."""
    capacity = max(sum(a.shape[0] for a in batch_inputs(b)) for b in batches)
    bare, checked = Staging(capacity, device), Staging(capacity, device)

    def floor(i: int) -> None:
        bare.stage(batch_inputs(batches[i]))

    def floor_checks(i: int) -> None:
        inputs = batch_inputs(batches[i])
        check_inputs(inputs, bounds)
        checked.stage(inputs)

    return {"floor": floor, "floor+checks": floor_checks}


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

    bounds = Bounds(kv_slots=limits.kv_slots, pool_rows=table.shape[0], context=args.context)
    variants = {
        "decode": lambda i: planner.replay(made["decode"][i], bs),
        "mixed": ragged("mixed"),
        **floor_variants(made["mixed"], bounds, device),  # the floor beside the mixed replay
        "extend": ragged("extend"),
    }
    between = None
    if args.evict:
        evict = np.zeros(args.evict << 18, dtype=np.int32)  # MB of int32

        def between() -> None:
            np.add(evict, 1, out=evict)  # every cache line written: what a step leaves behind

    timed = time_paired(
        variants, warmup=args.warmup, iters=args.iters, ratios_to=("floor",), between=between
    )
    batches_of = {"floor": "mixed", "floor+checks": "mixed"}  # the floor rows time mixed batches
    tokens = {
        name: sorted(b.num_tokens for b in made[batches_of.get(name, name)][args.warmup :])
        for name in variants
    }
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
