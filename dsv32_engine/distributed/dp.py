"""Data-parallel attention: ranks with their own batches agree, each step, on what runs.

Each rank has its own requests, but every forward's FFN exchanges rows with every
peer (the MoE's collective), so all ranks must run the same number of forwards, and
every CUDA graph replay must be of the same size (the exchanged tensors have the
graph's static shape). Once per loop step every rank contributes a few integers
(its step, whether it still has work, and per forward slot its mode, requests, query
tokens and KV tokens); one all-gather of that ``[world, 2 + 4 * slots]`` int64 table on the host
group gives every rank the same table, and every rank derives the same decision:

- a slot no rank has a batch for is skipped by all;
- a slot where every batch can replay a graph (uniform modes planned alike, idle
  planned as decode) replays the graph of the smallest captured size that holds the
  largest batch, on every rank; a rank with no batch there replays an IDLE batch of
  that size (every row padding: the null request, the null KV slot);
- a slot of ragged batches (extend, or mixed) of one mode replays the smallest token
  bucket that holds the most tokens any rank has, if every rank's KV is within the
  static bound; a rank with no batch there replays the same bucket with a one-token
  extend of the null request, so one rank's prefill no longer sends its peers eager;
- otherwise (modes differ, or a batch is larger than every graph) every rank runs
  that slot eagerly, together (as SGLang does when any DP rank extends); the FFN
  exchange pads each rank's rows to the largest rank's token count.

The loop ends when no rank has work left, on every rank at the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsv32_engine.distributed.agree import RankMismatch, gather_table
from dsv32_engine.distributed.group import DistContext
from planner.batch import ForwardMode

MODES = tuple(ForwardMode)
NONE = -1
"""Mode code of a slot this rank has no batch for."""

Route = Callable[[ForwardMode, int, int, int], tuple[int | None, str | None]]
"""``GraphRunner.route(mode, bs, tokens, kv_tokens)``: the graph size that holds a batch
(requests, or a ragged batch's tokens), or ``None`` and why not."""
WIDTH = 4
"""Integers per slot in the gathered table: mode, requests, query tokens, KV tokens."""


@dataclass(frozen=True)
class Slot:
    """One forward this rank wants this step: its mode, requests and query tokens."""

    mode: ForwardMode | None = None
    bs: int = 0
    tokens: int = 0
    kv_tokens: int = 0
    """A ragged batch's KV (the sum of its lengths): ragged graphs hold a bounded amount."""


@dataclass(frozen=True)
class Decision:
    """What every rank runs in one slot of one step (the same on every rank)."""

    run: bool
    size: int | None = None
    """The graph size every rank replays; ``None``: all ranks run this slot eagerly."""
    max_rows: int = 0
    """The most query rows any rank's forward has: the FFN exchange pads to it when eager."""
    modes: tuple[str, ...] = ()
    """Each rank's mode in this slot (``idle`` for a rank without a batch), for logs."""


@dataclass(frozen=True)
class StepPlan:
    """The agreed step: whether any rank has work, and one decision per slot."""

    active: bool
    slots: tuple[Decision, ...]


def encode(step: int, active: bool, slots: Sequence[Slot]) -> list[int]:
    out = [step, int(active)]
    for slot in slots:
        code = NONE if slot.mode is None else MODES.index(slot.mode)
        out += [code, slot.bs, slot.tokens, slot.kv_tokens]
    return out


def decide(table: list[list[int]], num_slots: int, route: Route) -> StepPlan:
    """The decision every rank derives from the same gathered table (pure: tested alone)."""
    steps = {row[0] for row in table}
    if len(steps) > 1:
        by_rank = {r: row[0] for r, row in enumerate(table)}
        raise RankMismatch(
            f"data-parallel ranks are at different steps: {by_rank}",
            field="step",
            expected=table[0][0],
            actual=by_rank,
        )
    decisions = []
    for s in range(num_slots):
        cols = [row[2 + WIDTH * s : 2 + WIDTH * (s + 1)] for row in table]
        present = [(MODES[c], bs, tokens, kv) for c, bs, tokens, kv in cols if c != NONE]
        modes = tuple(MODES[c].value if c != NONE else "idle" for c, *_ in cols)
        if not present:
            decisions.append(Decision(run=False, modes=modes))
            continue
        max_rows = max(max(tokens for _, _, tokens, _ in present), 1)
        planned = {mode.plans_as for mode, *_ in present}
        size = None
        if len(planned) == 1:
            size, _ = route(
                next(iter(planned)),
                max(bs for _, bs, _, _ in present),
                max(tokens for _, _, tokens, _ in present),
                max(kv for *_, kv in present),
            )
        decisions.append(Decision(run=True, size=size, max_rows=max_rows, modes=modes))
    return StepPlan(active=any(row[1] for row in table), slots=tuple(decisions))


def agree(
    ctx: DistContext, step: int, active: bool, slots: Sequence[Slot], route: Route
) -> StepPlan:
    """One all-gather of every rank's wishes, then the same :func:`decide` on every rank."""
    table = gather_table(encode(step, active, slots), ctx.host_group).tolist()
    return decide(table, len(slots), route)
