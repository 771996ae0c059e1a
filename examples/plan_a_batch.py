"""Plan one decode batch and one extend batch eagerly, and read the frozen plans a layer gets.

What an engine does once per forward, without graphs: turn its scheduler's batch into a
``ForwardBatch`` (KV lengths on the host, the request-pool rows, the engine's
``req_to_token`` table, the KV slots the new tokens are written to), call
``planner.plan(batch)``, and hand the returned ``PlanSet`` to the model. Every layer reads
the same frozen plan object (``plans["nsa"]``); no layer computes metadata. A bad batch is
refused at the door with a ``PlanError`` naming the field and the limit.

Runs on the CPU in a second or two: ``python examples/plan_a_batch.py``.
"""

from __future__ import annotations

import torch

from planner import ForwardBatch, ForwardMode, Limits, PlanError, Planner, PlanSet, PlanWriteError

MAX_BATCH, MAX_CONTEXT, PAGE = 8, 1024, 64


def token_table() -> torch.Tensor:
    """The engine's ``req_to_token``: row r holds the KV slot of each token of request r.
    Row 0 is the null request (all slot 0), which padding rows point at."""
    table = torch.zeros(MAX_BATCH + 1, MAX_CONTEXT, dtype=torch.int32)
    for row in range(1, MAX_BATCH + 1):
        table[row] = row * MAX_CONTEXT + torch.arange(MAX_CONTEXT, dtype=torch.int32)
    return table


def layer(plans: PlanSet) -> None:
    """What one attention layer does with the plans: read typed fields, never compute them."""
    plan = plans["nsa"]  # an NSAPlan for decode, an NSAExtendPlan for extend
    print(f"  layer reads {type(plan).__name__}: positions={plan.positions.tolist()}")


def main() -> None:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, page_size=PAGE, num_sms=8)
    # two backends in one planner: a field both declare the same way is computed once
    planner = Planner(["nsa", "paged"], limits, options={"nsa": {"topk": 128}})
    table = token_table()

    # decode: one new token per request; seq_lens_cpu counts it already
    lens = torch.tensor([300, 17, 900], dtype=torch.int32)
    rows = torch.tensor([1, 2, 3], dtype=torch.int32)
    decode = ForwardBatch(
        seq_lens_cpu=lens,
        req_pool_indices=rows,
        req_to_token=table,
        out_cache_loc=table[rows.long(), (lens - 1).long()],  # slot of each new token
    )
    plans = planner.plan(decode)
    print(plans)
    nsa = plans["nsa"]
    print("decode nsa.topk_lens:", nsa.topk_lens.tolist())
    print("decode nsa.page_table shape:", tuple(nsa.page_table.shape))
    print("decode nsa.schedule (deep_gemm paged MQA) shape:", tuple(nsa.schedule.shape))
    print("decode nsa scalars:", nsa.scalars())
    print("decode paged.cu_seqlens_k:", plans["paged"].cu_seqlens_k.tolist())
    layer(plans)

    # extend (prefill): request 4 adds its 5 first tokens, request 5 adds 8 after 32 cached
    extend = ForwardBatch(
        seq_lens_cpu=torch.tensor([5, 40], dtype=torch.int32),
        req_pool_indices=torch.tensor([4, 5], dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.cat([table[4, 0:5], table[5, 32:40]]),  # request-major
        mode=ForwardMode.EXTEND,
        extend_lens_cpu=torch.tensor([5, 8], dtype=torch.int32),
    )
    plans = planner.plan(extend)
    print(plans)  # the paged backend plans no extend batch: only nsa's plan is here
    nsa = plans["nsa"]
    print("extend nsa.qo_indptr:", nsa.qo_indptr.tolist())
    print("extend nsa.kv_indptr:", nsa.kv_indptr.tolist())
    print("extend nsa.token_request:", nsa.token_request.tolist())
    layer(plans)

    # plans are read-only: rebinding a field is refused, naming it (graphs.GraphRunner also
    # refuses a layer's in-place write into a plan; debug mode sees writes torch cannot count)
    try:
        nsa.topk = 1
    except PlanWriteError as exc:
        print("refused:", exc)

    # bad input is refused at the door, naming the field and the limit
    too_long = ForwardBatch(
        seq_lens_cpu=torch.tensor([MAX_CONTEXT + 1], dtype=torch.int32),
        req_pool_indices=torch.tensor([1], dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor([1], dtype=torch.int32),
    )
    try:
        planner.plan(too_long)
    except PlanError as exc:
        print("refused:", exc)

    print("op calls so far:", dict(planner.stats.op_calls))
    print("plan_a_batch: ok")


if __name__ == "__main__":
    main()
