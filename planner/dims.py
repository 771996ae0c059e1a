"""Symbolic dimensions of plan tensors.

A schema says ``("reqs", "pages")`` instead of numbers because the same field
has two sizes: the batch's own in an eager plan, and the static maximum in a
captured one. Keeping shapes symbolic lets one declaration size both.

Grammar: an int, a name, or ``name+int`` / ``name-int`` (``"reqs+1"``, ``"sms+1"``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

import torch

from planner import native
from planner.errors import SchemaError

DimExpr = int | str

_EXPR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:([+-])\s*(\d+))?\s*$")


@functools.lru_cache(maxsize=4096)
def parse_dim(expr: DimExpr) -> tuple[str | None, int]:
    """Split a dimension expression into (name, offset); a literal has no name."""
    if isinstance(expr, bool):
        raise SchemaError("dimension must be an int or a name", expected="int|str", actual=expr)
    if isinstance(expr, int):
        if expr < 0:
            raise SchemaError("dimension literal is negative", expected=">= 0", actual=expr)
        return None, expr
    match = _EXPR.match(expr)
    if match is None:
        raise SchemaError(
            "cannot parse dimension", expected="'name', 'name+N' or 'name-N'", actual=expr
        )
    name, sign, number = match.groups()
    offset = int(number) if number else 0
    return name, -offset if sign == "-" else offset


def dim_names(shape: Sequence[DimExpr]) -> set[str]:
    """The symbolic names a shape depends on."""
    return {name for name, _ in map(parse_dim, shape) if name is not None}


def resolve_shape(
    shape: Sequence[DimExpr], dims: Mapping[str, int], *, field: str = "?"
) -> tuple[int, ...]:
    """Numbers for a symbolic shape, given the values of its names."""
    out = []
    for expr in shape:
        name, offset = parse_dim(expr)
        if name is None:
            out.append(offset)
            continue
        if name not in dims:
            raise SchemaError(
                f"shape uses unknown dimension {name!r}", field=field, expected=sorted(dims)
            )
        size = dims[name] + offset
        if size < 0:
            raise SchemaError("dimension resolves negative", field=field, actual=(expr, size))
        out.append(size)
    return tuple(out)


def lengths_max_sum(lengths: torch.Tensor, empty_max: int) -> tuple[int, int]:
    """The longest and the total of a batch's host KV lengths, which size an eager plan;
    ``(empty_max, 1)`` for an empty batch. One C call where it can (``planner.native``),
    else numpy's two reductions, which agree with it."""
    fast = native.max_sum()
    if fast is not None:
        got = fast(lengths)
        if got is not None:
            return got
    lens = lengths.numpy()
    if not lens.size:
        return empty_max, 1
    return int(lens.max()), int(lens.sum())
