"""Capture, record and replay a decode step with the planner, on the CPU (emulated graphs).

Part 1 is the three phases by hand, what a graph runner does inside: ``planner.capture``
makes plans over static buffers sized for a batch size, ``planner.record`` records the
device check of the step's inputs and the graph-safe ops inside the graph capture (before
the layers), and for every later batch ``planner.replay`` sends the step's inputs (written
once into the planner's staging slot, by the engine itself through ``planner.step_inputs``
or from a ``ForwardBatch``) before ``graph.replay()``. ``planner.read`` reads the step's
outputs with the check's error word: a bad batch is refused there, naming the field.

Part 2 is ``graphs.GraphRunner``, the way an engine's decode loop uses it: capture sizes
(a ladder up to ``max_batch``), batches of varying sizes padded up to the next captured
size, and eager fallbacks that are counted (and warned about once), never silent. With
``debug=True`` every replay is checked against a fresh eager plan, bit for bit.

On the CPU ``EmulatedGraph`` stands in for ``torch.cuda.CUDAGraph`` (it re-runs the Python;
a real graph does not), so this runs anywhere in a second or two:
``python examples/graph_replay.py``. On a GPU the same code captures real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from backends.paged import paged_attention
from graphs import EmulatedGraph, EmulatedPool, GraphRunner, GraphWarning, capture_ladder
from planner import BatchError, ForwardBatch, ForwardMode, Limits, Planner, PlanSet

MAX_BATCH, MAX_CONTEXT, PAGE, HEADS, DIM = 8, 128, 16, 2, 8
SLOTS = (MAX_BATCH + 1) * MAX_CONTEXT


class TinyModel:
    """One paged-attention layer over a KV cache: reads only the ``paged`` plan."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(32, HEADS * DIM, generator=gen, dtype=torch.float64)
        self.k_cache = torch.zeros(SLOTS, HEADS, DIM, dtype=torch.float64)
        self.v_cache = torch.zeros_like(self.k_cache)

    def __call__(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> torch.Tensor:
        plan = plans["paged"]
        x = self.embed[inputs["input_ids"]].view(-1, HEADS, DIM)
        loc = plan.out_cache_loc.long()  # padding rows write the null slot 0
        self.k_cache.index_copy_(0, loc, x)
        self.v_cache.index_copy_(0, loc, x)
        return paged_attention(plan, x, self.k_cache, self.v_cache, DIM**-0.5).reshape(len(x), -1)


def token_table() -> torch.Tensor:
    """``req_to_token``: row r holds request r's KV slots; row 0 is the null request."""
    table = torch.zeros(MAX_BATCH + 1, MAX_CONTEXT, dtype=torch.int32)
    for row in range(1, MAX_BATCH + 1):
        table[row] = row * MAX_CONTEXT + torch.arange(MAX_CONTEXT, dtype=torch.int32)
    return table


def decode_batch(table: torch.Tensor, bs: int, step: int) -> tuple[ForwardBatch, dict]:
    """Requests 1..bs, each ``10 + step + request`` tokens long after this step's token."""
    rows = torch.arange(1, bs + 1, dtype=torch.int32)
    lens = 10 + step + rows
    batch = ForwardBatch(
        seq_lens_cpu=lens,
        req_pool_indices=rows,
        req_to_token=table,
        out_cache_loc=table[rows.long(), (lens - 1).long()],
    )
    return batch, {"input_ids": (lens % 32).long()}


def by_hand(table: torch.Tensor) -> None:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, page_size=PAGE, kv_slots=SLOTS)
    planner = Planner(["paged"], limits)
    model, bs = TinyModel(), 4
    static = planner.capture(bs, req_to_token=table)  # plans over static buffers, dummy batch
    ids = torch.zeros(bs, dtype=torch.int64)  # the graph's static model input
    graph, pool = EmulatedGraph(), EmulatedPool()  # on a GPU: new_graph("cuda"), new_pool("cuda")

    def body() -> torch.Tensor:
        planner.record(bs)  # graph-safe ops, once per batch, before the layers
        return model({"input_ids": ids}, static)

    out = graph.capture(body, pool=pool)
    batch, inputs = decode_batch(table, 3, step=0)  # 3 requests replay the size-4 graph
    plans = planner.replay(batch, bs)  # written into the staging slot and sent; no value read
    ids[:3].copy_(inputs["input_ids"])
    graph.replay()  # the device checks the inputs, pads, then the ops and the layers
    planner.graph_launched()  # a no-op unless the graph pulls its own inputs
    tokens = planner.read(out.argmax(dim=-1))  # the outputs and the check's word, one copy
    print("by hand: replay returned the captured plans:", plans is static, "tokens:", tokens[:3])

    # An engine writes each step once, into the planner's slot: no batch tensors at all.
    step = planner.step_inputs()  # typed views of the pinned slot the next replay sends
    step.seq_lens[:2] = [12, 30]  # KV lengths, this step's token included
    step.extend_lens[:2] = 1  # one new token each (decode)
    step.req_pool_indices[:2] = [1, 2]
    step.out_cache_loc[:2] = [table[1, 11], table[2, 29]]
    step.set_counts(2, 2, positions_given=False)  # positions: derived on the device
    planner.replay(step.batch(table), bs)
    graph.replay()
    planner.read(out.argmax(dim=-1))  # clean: nothing raised

    # A bad batch is refused by the device check: no op reads its rows (they hold the pads)
    # and the refusal comes with the step's outputs, naming the field, the row and the value.
    bad, _ = decode_batch(table, 2, step=0)
    bad = dataclasses.replace(bad, out_cache_loc=torch.tensor([5, SLOTS + 7], dtype=torch.int32))
    planner.replay(bad, bs)
    graph.replay()
    try:
        planner.read(out.argmax(dim=-1))
    except BatchError as err:
        print("by hand: refused at read:", err)
    print("by hand: padded seq_lens:", plans["paged"].seq_lens.tolist(), "rows out:", len(out))


def with_runner(table: torch.Tensor, *, debug: bool, show: bool = True) -> GraphRunner:
    planner = Planner(
        ["paged"], Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, page_size=PAGE), debug=debug
    )
    runner = GraphRunner(
        planner,
        TinyModel(),
        req_to_token=table,  # the one table every graph reads: never reallocate it
        static_inputs={"input_ids": torch.int64},
        sizes=[1, 2, 4],  # default: capture_ladder(max_batch)
    )
    stats = runner.capture()  # largest first, one shared pool
    if show:
        print("captured:", stats.captured, "; default ladder for 8:", capture_ladder(MAX_BATCH))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        for step, bs in enumerate([3, 1, 4, 2, 6, 7]):  # 6 and 7 exceed the largest size
            batch, inputs = decode_batch(table, bs, step)
            size, reason = runner.route(ForwardMode.DECODE, bs)
            out = runner.step(batch, inputs)  # outputs cover the real rows only
            if show:
                print(
                    f"  step {step}: bs={bs} -> graph size {size} / eager {reason}; rows {len(out)}"
                )
    for warning in caught if show else ():
        print("  warned once:", str(warning.message).split(";")[0])
    return runner


def main() -> None:
    torch.manual_seed(0)
    table = token_table()
    by_hand(table)
    runner = with_runner(table, debug=False)
    stats = runner.stats
    print(f"replays {dict(stats.replays)}, eager fallbacks {dict(stats.eager)}")
    print(f"padded rows {stats.padded_rows} of {stats.padded_rows + stats.real_rows}")
    runner = with_runner(table, debug=True, show=False)  # replay == eager, checked every step
    print("debug mode verified", runner.planner.stats.verified, "replays against eager plans")
    print("graph_replay: ok")


if __name__ == "__main__":
    main()
