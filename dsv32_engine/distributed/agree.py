"""Agreement on a few integers across ranks: one small all-reduce when they agree.

``check_equal`` all-reduces ``[v, -v]`` with MAX: the first half is every field's
maximum over ranks, the second half minus its minimum, so ``max == min`` proves all
ranks hold the same values with one collective of ``2 * len(v)`` int64. Only when they
disagree (every rank sees that, because the result is the same on every rank) is a
second collective run, an all-gather of every rank's values, so the error can name the
ranks and the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsv32_engine.distributed.group import all_gather_flat
from planner.errors import PlanError


class RankMismatch(PlanError):
    """Ranks that must agree (on a batch signature, a plan, a step) do not."""


def gather_table(values: Sequence[int], group: Any) -> torch.Tensor:
    """Every rank's ``values`` as a ``[world, len(values)]`` int64 table (one all-gather)."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    table = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64)
    all_gather_flat(table, mine, group=group)  # gloo wants the flat output
    return table.view(-1, mine.numel())


def check_equal(
    values: Sequence[int], names: Sequence[str], group: Any, *, what: str, show: Any = None
) -> None:
    """Raise :class:`RankMismatch` on every rank unless every rank passed the same ``values``.

    ``names`` names each value (the error's field is ``what.NAME``); ``show(name, value)``
    may render a value for the message (a mode's name instead of its code).
    """
    n = len(values)
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(both[:n], -both[n:]):
        return
    table = gather_table(values, group)
    differs = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
    col = differs[0]
    name = names[col]
    render = show or (lambda _name, value: value)
    by_rank = {r: render(name, int(v)) for r, v in enumerate(table[:, col].tolist())}
    odd = [r for r, v in enumerate(table[:, col].tolist()) if v != int(table[0, col])]
    raise RankMismatch(
        f"ranks disagree on the {what} {name}: rank {odd[0]} has {by_rank[odd[0]]}, "
        f"rank 0 has {by_rank[0]} (every rank: {by_rank}; also differing: "
        f"{[names[c] for c in differs[1:]] or 'nothing else'})",
        field=f"{what}.{name}",
        expected=by_rank[0],
        actual=by_rank[odd[0]],
    )
