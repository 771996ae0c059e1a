"""The places of an eager plan's fields in its memory: what :mod:`planner.fresh` works out per
shape, and what :mod:`planner.fresh_pool` cuts recycled memory by.

A plan's int32 fields share one buffer: the staged region (the inputs and the host
pass's outputs, placed by the dimensions the host pass's shapes name, fixed over a
decode), then the fields computed on the device, placed per shape. Other dtypes get one
allocation each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from planner.host_pass import NativePass, Placement
from planner.program import Key

Piece = tuple[Key, int, tuple[int, ...], tuple[int, ...]]
"""``(key, offset, shape, stride)``: one field's contiguous view of a buffer."""


@dataclass(frozen=True)
class Cuts:
    """Views of one buffer in one ``split_with_sizes`` call: the pieces and the gaps between."""

    sizes: tuple[int, ...]
    picks: tuple[tuple[Key, int, tuple[int, ...]], ...]
    """``(key, piece, shape)``: several keys may name one piece (one staged source)."""
    end: int = 0
    """Where the cut pieces end: :meth:`then` cuts more after it."""

    @classmethod
    def of(cls, pieces: Iterable[tuple[Key, int, tuple[int, ...]]], total: int | None) -> Cuts:
        """``pieces`` are ``(key, offset, shape)``, non-overlapping unless equal; a last gap up
        to ``total``, or none (more pieces to follow) where it is None."""
        return _OPEN.then(pieces, total)

    def then(self, pieces: Iterable[tuple[Key, int, tuple[int, ...]]], total: int | None) -> Cuts:
        """These cuts and ``pieces`` after them: a layout's device fields after its staged
        region, whose cuts are kept while the fields' shapes change every step."""
        sizes, picks, at = list(self.sizes), list(self.picks), self.end
        index: dict[tuple[int, int], int] = {}
        for key, offset, shape in sorted(pieces, key=_offset):
            numel = math.prod(shape)
            where = (offset, numel)
            if where not in index:
                if offset < at:
                    raise ValueError(f"{key} at {offset} overlaps the pieces before it (to {at})")
                if offset > at:
                    sizes.append(offset - at)
                index[where] = len(sizes)
                sizes.append(numel)
                at = offset + numel
            picks.append((key, index[where], shape))
        if total is not None:
            if total > at:  # no empty last piece: each piece is a tensor to make
                sizes.append(total - at)
            at = total
        return Cuts(tuple(sizes), tuple(picks), at)

    def views(self, buffer: torch.Tensor, out: dict[Key, torch.Tensor]) -> None:
        parts = buffer.split_with_sizes(self.sizes)
        for key, piece, shape in self.picks:
            part = parts[piece]
            out[key] = part if len(shape) == 1 else part.view(shape)


@dataclass(frozen=True)
class StagedPart:
    """What a layout's staged region holds: the inputs and the host pass's outputs, placed
    by the dimensions the host pass's shapes name (fixed over a decode: the request count,
    the SMs), and the host pass compiled for those places."""

    host: tuple[Placement, ...]
    native: NativePass | None
    """The host pass compiled for these placements, or None (numpy twins only)."""
    staged_size: int
    sent: int
    """int32 elements one copy sends (the staged size, as the stager rounds it)."""
    cuts: Cuts
    """The staged fields' cuts, open: a layout adds its device fields after them."""


@dataclass(frozen=True)
class FreshLayout:
    """One set of dimensions: one buffer of the staged inputs, the host-pass outputs and the
    int32 device-computed fields, and one allocation per other dtype.

    Only the device fields' places are worked out per shape (a decode's longest request
    grows every step); the whole buffer's cuts are made on first use, by plans whose
    memory is not recycled (a recycled buffer keeps its staged views, ``planner.fresh_pool``).
    """

    part: StagedPart
    device_extra: int
    """int32 elements of device-computed fields after the staged ones, in the same buffer."""
    device_pieces: tuple[Piece, ...]
    """The int32 device fields as ``(key, offset, shape, stride)``."""
    arena_pieces: Mapping[torch.dtype, tuple[int, tuple[Piece, ...]]]
    """The other dtypes' device fields the same way, with each allocation's size."""

    @cached_property
    def staged(self) -> Cuts:
        """The views of the whole buffer: the staged fields, then the device ones."""
        total = self.part.sent + self.device_extra
        return self.part.cuts.then([p[:3] for p in self.device_pieces], total)

    @cached_property
    def arenas(self) -> dict[torch.dtype, tuple[int, Cuts]]:
        """The other dtypes' device fields: one allocation each, and its views."""
        return {
            dt: (total, Cuts.of([p[:3] for p in pieces], total))
            for dt, (total, pieces) in self.arena_pieces.items()
        }


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (an empty dimension counts as one)."""
    if len(shape) == 1:
        return (1,)
    if len(shape) == 2:
        return (max(shape[1], 1), 1)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _offset(piece: tuple[Key, int, tuple[int, ...]]) -> int:
    return piece[1]


_OPEN = Cuts((), (), 0)
