"""A forward's outputs under graphs: which dimension is the batch, and the real rows of it.

A graph computes every row of its size, padding included; the caller must only
see the real rows. Each output's leading dimension is classified once at
capture (rows or requests) and sliced on every replay; an output that is
neither cannot be sliced, so capture refuses it rather than hand back padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from graphs.emulated import flatten_outputs
from planner.errors import ConfigError


class GraphOutputError(ConfigError):
    """The forward's outputs cannot be captured or sliced; fails every size, so it is raised."""


def output_kinds(outputs: Any, reqs: int, rows: int) -> list[str]:
    """Per output tensor, whether its leading dimension is the rows or the requests."""
    try:
        flat = flatten_outputs(outputs)
    except TypeError as exc:
        raise GraphOutputError(str(exc), field="forward") from None
    kinds = []
    for tensor in flat:
        if tensor.dim() and tensor.shape[0] == rows:
            kinds.append("rows")
        elif tensor.dim() and tensor.shape[0] == reqs:
            kinds.append("reqs")
        else:
            raise GraphOutputError(
                "every output's leading dimension must be the batch's rows or requests (to slice padding off)",
                field="forward",
                expected=f"{rows} rows or {reqs} requests",
                actual=tuple(tensor.shape),
            )
    return kinds


def slice_outputs(outputs: Any, kinds: Iterator[str], reqs: int, rows: int) -> Any:
    """The outputs' real rows (views, same structure)."""
    if isinstance(outputs, torch.Tensor):
        return outputs[: rows if next(kinds) == "rows" else reqs]
    if isinstance(outputs, dict):
        return {key: slice_outputs(value, kinds, reqs, rows) for key, value in outputs.items()}
    return type(outputs)(slice_outputs(value, kinds, reqs, rows) for value in outputs)
