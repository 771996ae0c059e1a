"""What each rank runs in the multi-process tests (module level, so spawned ranks import it).

Every scenario takes the rank's ``DistContext`` and returns a JSON-able dict; expected
refusals (``RankMismatch``) are caught and reported with the step they came at, so a
test can check that every rank raised, at the same step, naming the same rank and field.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch

from dsv32_engine.distributed.agree import RankMismatch
from dsv32_engine.distributed.exchange import RowExchange
from dsv32_engine.distributed.group import DistContext
from dsv32_engine.distributed.tp import TPCheck
from dsv32_engine.serving import speculative
from dsv32_engine.serving.accept import accept_greedy
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.rank_engines import RankEngine
from dsv32_engine.serving.report import debug_checks
from dsv32_engine.serving.run_config import load_run_config
from planner import ForwardBatch, ForwardMode, Limits, Planner
from tests.support import TINY_YAML
from tests.support.batches import idle_batch, make_pool, random_batch
from tests.support.planners import replay_smallest

MAX_BATCH, MAX_CTX, PAGE, POOL = 8, 256, 64, 20
SIZES = (1, 2, 4, 8)


def _other_requests(batch: ForwardBatch, table: torch.Tensor) -> ForwardBatch:
    """The same signature (sizes, lengths) over other requests: only digests can tell."""
    rows = table.shape[0] - 1
    pool = batch.req_pool_indices.long() % rows + 1  # a bijection on 1..rows
    loc = table[pool, batch.seq_lens_cpu.long() - 1]
    return dataclasses.replace(batch, req_pool_indices=pool, out_cache_loc=loc)


def _longer(batch: ForwardBatch, table: torch.Tensor) -> ForwardBatch:
    lens = batch.seq_lens_cpu.clone()
    lens[0] = MAX_CTX if int(lens.max()) < MAX_CTX else 1
    loc = table[batch.req_pool_indices.long(), lens.long() - 1]
    return dataclasses.replace(batch, seq_lens_cpu=lens, out_cache_loc=loc)


def _fewer(batch: ForwardBatch, table: torch.Tensor) -> ForwardBatch:
    keep = max(batch.bs - 1, 0)
    return ForwardBatch(
        batch.seq_lens_cpu[:keep],
        batch.req_pool_indices[:keep],
        table,
        batch.out_cache_loc[:keep],
        mode=ForwardMode.DECODE if keep else ForwardMode.IDLE,
    )


def _other_pages(batch: ForwardBatch, table: torch.Tensor) -> ForwardBatch:
    """The same batch over other pages: rank 1's token table rows of the batch's requests
    hold another request's slots (restored after the step). The batch's host tensors are
    the same, so only the plan digests can tell."""
    rows = batch.req_pool_indices.long()
    table[rows] = table[rows % (table.shape[0] - 1) + 1].clone()
    return batch


PERTURB = {
    "requests": _other_requests,
    "pages": _other_pages,
    "max_len": _longer,
    "bs": _fewer,
}


def tp_plans(
    ctx: DistContext, steps: int, seed: int, perturb: dict[str, str] | None = None
) -> dict[str, Any]:
    """``steps`` random batches (the same on every rank: one seed), each checked by
    ``TPCheck`` (signature before, digests after) and replayed, eager every fourth and
    idle every tenth. ``perturb`` {step: kind}: rank 1 alone changes that step's batch."""
    table = make_pool(POOL, MAX_CTX, PAGE, seed=3)
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CTX, page_size=PAGE)
    planner = Planner(["nsa", "paged"], limits)
    for bs in SIZES:
        planner.capture(bs, ForwardMode.DECODE, req_to_token=table)
    check = TPCheck(ctx, digests=True)
    rng = random.Random(seed)
    errors, phases = [], {"replay": 0, "eager": 0}
    for step in range(steps):
        batch = (
            idle_batch(table)
            if step % 10 == 9
            else random_batch(rng, table, max_batch=MAX_BATCH, max_context=MAX_CTX)
        )
        kind = (perturb or {}).get(str(step))
        saved = table.clone()
        if kind is not None and ctx.rank == 1:
            batch = PERTURB[kind](batch, table)
        try:
            check.before(batch)
            if step % 4 == 3:
                plans = planner.plan(batch)
            else:
                _, plans = replay_smallest(planner, batch, SIZES)
            phases[plans.phase] += 1
            check.after(plans)
        except RankMismatch as exc:
            errors.append({"step": step, "field": exc.field, "message": str(exc)})
        table.copy_(saved)  # a perturbed token table is rank 1's for one step only
    return {
        "errors": errors,
        "phases": phases,
        "signature_checks": check.steps,
        "digest_checks": check.digest_steps,
    }


def _captured(engine) -> list[str]:
    """Every captured graph, decode sizes and prompt-chunk token buckets: ``decode/4``."""
    runner = engine.runner
    return [f"{m.value}/{s}" for m in runner.modes for s in runner.captured_sizes(m)]


def rank_engine(
    ctx: DistContext, overrides: dict[str, Any], perturb: str | None = None
) -> dict[str, Any]:
    """One rank of a ``tp x dp_attention`` job of the tiny model (the overrides say which):
    its summary, forward trace, tokens and speculative stats.

    ``perturb`` makes rank 1 alone decide one verify differently: ``shorter`` accepts one
    token less (at the first verify that accepted two or more), ``token`` keeps a different
    bonus token (at the first verify). The refusal every rank must then raise is returned.
    """
    config = load_run_config(TINY_YAML, overrides)
    engine = RankEngine(config, ctx)
    engine.trace = []
    spec = engine.speculation
    perturbed: list[int] = []
    if perturb is not None and ctx.rank == 1:

        def decide_otherwise(drafts, argmax):
            accepted = accept_greedy(drafts, argmax)
            if perturbed:
                return accepted
            if perturb == "shorter" and len(accepted) >= 2:
                perturbed.append(spec.stats.verify_steps)
                return accepted[:-1]
            if perturb == "token":
                perturbed.append(spec.stats.verify_steps)
                return [*accepted[:-1], (accepted[-1] + 1) % engine.model_config.vocab_size]
            return accepted

        speculative.accept_greedy = decide_otherwise  # this spawned rank's module only
    error = None
    try:
        result = engine.run(progress=False, keep_tokens=True)
        tokens = {str(k): v for k, v in result.tokens.items()}
    except RankMismatch as exc:
        tokens = {}
        error = {"field": exc.field, "message": str(exc)}
    return {
        **engine.rank_summary(),
        **debug_checks(engine),
        "trace": engine.trace,
        "tokens": tokens,
        "error": error,
        "perturbed_at": perturbed,
        "captured": _captured(engine),
        "forwards": engine.forward_steps,
        "layers": len(engine.model.layers),
        "speculative": spec.summary() if spec is not None else None,
        "graph_replays": sum(
            sum(runner.stats.replays.values())
            for runner in [engine.runner, *(spec.runners.values() if spec else [])]
        ),
    }


def single_tokens(overrides: dict[str, Any]) -> dict[str, list[int]]:
    """The same workload on one process, no distributed code at all."""
    engine = DecodeEngine(load_run_config(TINY_YAML, overrides))
    return {str(k): v for k, v in engine.run(progress=False, keep_tokens=True).tokens.items()}


def skipped_exchange(ctx: DistContext, forwards: int) -> dict[str, Any]:
    """Rank 1 leaves one forward's FFN exchange out: rank 0 must fail (timeout), not hang."""
    exchange = RowExchange(ctx)
    x = torch.full((3, 4), float(ctx.rank))
    seen, error = [], None
    try:
        for _ in range(forwards - (ctx.rank == 1)):
            out = exchange(x, lambda rows: rows * 2)
            seen.append(out.tolist())
    except RuntimeError as exc:  # gloo's timeout
        error = str(exc).splitlines()[0]
    if ctx.rank == 1:
        time.sleep(ctx.timeout_s + 1.0)  # stay in the group: rank 0 must time out, not see a close
    return {"seen": seen, "error": error, "calls": exchange.calls}
