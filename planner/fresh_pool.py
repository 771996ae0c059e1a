"""Eager plans' memory, recycled once nothing can read it, with its views already cut.

An eager plan owns its tensors, so each used to get a new device buffer and a dozen new
views of it: on a GPU host the views alone cost about 27 us of a 168 us plan at bs 256,
and the allocation 5 more. A serving loop drops each step's plans a step later, so the
memory of an earlier step can be taken back, views and all, as torch's caching allocator
takes back a freed block (and on the same terms: the memory is reused on the stream it
was handed out on, so work queued on that stream has read it by then).

A buffer is taken back only when nothing outside the pool can read it:
- no tensor but the pool's own shares its storage (a slice, a view or a numpy array of a
  plan tensor each hold the storage);
- nothing holds one of the pool's views, from Python (a plan, a kept field) or from C++
  (a DLPack capsule, an extension keeping an ``at::Tensor``), nor its storage object.
Each is a count read in one C call per object, against the counts the pool itself makes.
Memory only the caller's raw pointers reach is as unprotected as a freed tensor's is.

Per staged part (the request count and what the host pass writes: fixed over a decode) a
few buffers are kept, grown to the next power of two a shape needs, so a decode whose
longest request grows every step only moves its device fields' views, in place. Kept
memory is bounded (``POOL_BYTES``); past it, and while a stream is being captured, plans
take new memory as before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch

from planner.fresh_layout import FreshLayout, Piece, StagedPart
from planner.program import Key

POOL_BYTES = 256 << 20
"""Device memory one storage (a mode and request count) keeps for recycling, at most."""
ENTRIES = 4
"""Buffers kept per staged part: a loop holding its last step's plans uses two."""
PARTS = 64
"""Staged parts kept buffers for (ragged batches' token counts each make one), at most."""
_MIN_ELEMENTS = 1024

_getrefcount = sys.getrefcount
_use_count = torch.Tensor._use_count
_storage_uses = torch._C._storage_Use_Count
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


class Recycled:
    """One kept buffer (and one per other dtype) with the views of the layout it last held."""

    __slots__ = (
        "part",
        "stream",
        "device",
        "buffer",
        "host",
        "arenas",
        "layout",
        "views",
        "nbytes",
        "capacity",
        "_staged",
        "_staged_views",
        "_storages",
        "_watch",
    )

    def __init__(
        self, part: StagedPart, stream: tuple[int, int], elements: int, device: torch.device
    ):
        self.part = part
        self.stream = stream
        self.device = device
        self.host: np.ndarray | None = None
        """The buffer as numpy on the CPU, where the stager fills the plan's memory itself."""
        self.arenas: dict[torch.dtype, torch.Tensor] = {}
        self.layout: FreshLayout | None = None
        self.views: dict[Key, torch.Tensor] = {}
        """What a plan of :attr:`layout` is handed (a copy of): every field's view."""
        self.nbytes = 0
        self.capacity = 0
        """int32 elements of :attr:`buffer`."""
        self._staged: dict[Key, torch.Tensor] = {}
        self._staged_views: tuple[torch.Tensor, ...] = ()
        self._storages: tuple = ()
        self._watch: tuple = ((), (), 0, (), 0, 0)
        self._allocate(elements)  # :attr:`buffer`, its :attr:`capacity` and :attr:`host`

    def unobserved(self) -> bool:
        """True when no tensor but the pool's shares its memory, and nothing holds one of
        its views or its storage objects."""
        uses, storages, storage_refs, watched, refs, view_uses = self._watch
        for cdata, expected in uses:
            if _storage_uses(cdata) != expected:
                return False
        return (
            sum(map(_getrefcount, storages)) == storage_refs
            and sum(map(_getrefcount, watched)) == refs
            and sum(map(_use_count, watched)) == view_uses
        )

    def needs_more(self, layout: FreshLayout) -> bool:
        """Whether holding ``layout`` means allocating (a larger buffer or arena)."""
        if self.capacity < layout.part.sent + layout.device_extra:
            return True
        arenas = self.arenas
        for dtype, (total, _pieces) in layout.arena_pieces.items():
            arena = arenas.get(dtype)
            if arena is None or arena.numel() < total:
                return True
        return False

    def move(self, layout: FreshLayout) -> None:
        """Hold ``layout``'s views within the memory held (``needs_more`` is False): the
        device fields' views are moved in place (``as_strided_``: the same objects, so the
        counts stand)."""
        views = self.views
        for key, offset, shape, stride in layout.device_pieces:
            views[key].as_strided_(shape, stride, offset)
        for _total, pieces in layout.arena_pieces.values():
            for key, offset, shape, stride in pieces:
                views[key].as_strided_(shape, stride, offset)
        self.layout = layout

    def fit(self, layout: FreshLayout, aliases: Mapping[Key, Key]) -> None:
        """Hold ``layout``'s views in memory grown where it needs more, every view cut
        anew (a new buffer's, or one that :meth:`needs_more` for ``layout``)."""
        self.layout = None
        self.views = {}
        self._watch = ((), (), 0, (), 0, 0)  # the last views die here, before the counts
        if self.capacity < _elements(layout):
            self._allocate(_capacity(_elements(layout)))
        if not self._staged:
            layout.part.cuts.then((), self.capacity).views(self.buffer, self._staged)
            for alias, owner in aliases.items():
                if owner in self._staged:
                    self._staged[alias] = self._staged[owner]
            self._staged_views = _unique(self._staged)
        views = dict(self._staged)
        _cut(self.buffer, layout.device_pieces, views)
        for dtype, (total, pieces) in layout.arena_pieces.items():
            arena = self.arenas.get(dtype)
            if arena is None or arena.numel() < total:
                arena = self.arenas[dtype] = torch.empty(
                    _capacity(total), dtype=dtype, device=self.device
                )
                self._sized()
            _cut(arena, pieces, views)
        for alias, owner in aliases.items():
            if alias not in views:
                views[alias] = views[owner]
        self.views, self.layout = views, layout
        self._settle()

    def _allocate(self, elements: int) -> None:
        """A new buffer: its staged views are cut on the next :meth:`fit`."""
        self._staged, self._staged_views = {}, ()
        self.buffer = torch.empty(elements, dtype=torch.int32, device=self.device)
        self.capacity = elements
        self.host = self.buffer.numpy() if self.device.type == "cpu" else None
        self._sized()

    def _sized(self) -> None:
        memory = (self.buffer, *self.arenas.values())
        self.nbytes = sum(t.numel() * t.element_size() for t in memory)
        self._storages = tuple(t.untyped_storage() for t in memory)

    def _settle(self) -> None:
        """The counts of an unobserved buffer, read as :meth:`unobserved` reads them (one
        storage use per pool tensor, one reference per slot the pool fills), with no
        other reference to a view alive in this frame. The storage objects are kept: torch
        hands the same one to every ``untyped_storage()`` call while it lives, so a caller
        keeping one raises its count."""
        staged = self._staged
        watched = self._staged_views + tuple(t for k, t in self.views.items() if k not in staged)
        storages = self._storages
        self._watch = (
            tuple((s._cdata, _storage_uses(s._cdata)) for s in storages),
            storages,
            sum(map(_getrefcount, storages)),
            watched,
            sum(map(_getrefcount, watched)),
            sum(map(_use_count, watched)),
        )


class FreshPool:
    """The recycled memory of one fresh storage; see the module docstring."""

    def __init__(self, device: torch.device, aliases: Mapping[Key, Key]) -> None:
        self.device = device
        self.aliases = aliases
        self._cuda = device.type == "cuda"
        self._index = device.index
        """None for a bare ``cuda``: memory is then the current device's, as allocations are."""
        self._parts: dict[int, list[Recycled]] = {}
        self.nbytes = 0
        self.recycled = 0
        """Takes that found an earlier plan's memory unobserved (a plan refused after it, by
        the staging checks, counts too)."""

    def take(self, layout: FreshLayout) -> Recycled | None:
        """Memory for a plan of ``layout``: an unobserved kept buffer, or a new one kept from
        now on; None where the plan must take fresh memory (past the budget, or capturing)."""
        stream: tuple[int, int] = (0, 0)  # (device, raw stream): every device's default is 0
        if self._cuda:
            if _capturing():
                return None  # a captured write would land in a later plan's memory
            index = self._index if self._index is not None else _current_device()
            stream = (index, _raw_stream(index))
        part = layout.part
        key = id(part)
        entries = self._parts.get(key)  # its entries keep ``part`` alive: the id is its own
        if entries is not None:
            for i, entry in enumerate(entries):  # the longest unused first
                if entry.stream == stream and entry.unobserved():
                    if i + 1 < len(entries):  # last: trimming keeps the one in use
                        entries.append(entries.pop(i))
                    if entry.layout is not layout and not self._fit(key, entry, layout):
                        return None
                    self.recycled += 1
                    return entry
        if _bytes(layout) > POOL_BYTES:
            return None
        if entries is None:
            if len(self._parts) >= PARTS:  # the longest unused part's memory goes
                self._drop(next(iter(self._parts)))
            entries = self._parts[key] = []
        elif len(entries) >= ENTRIES:  # the longest held: its plan keeps its memory alive
            self.nbytes -= entries.pop(0).nbytes
        entry = Recycled(part, stream, _capacity(_elements(layout)), self.device)
        entries.append(entry)
        entry.fit(layout, self.aliases)
        self.nbytes += entry.nbytes
        self._trim(entries)
        return entry

    def _fit(self, key: int, entry: Recycled, layout: FreshLayout) -> bool:
        """``entry`` holding ``layout``'s views, the budget kept; False where growing it for
        ``layout`` would pass the budget on its own."""
        if not entry.needs_more(layout):
            entry.move(layout)
            return True
        if _bytes(layout) > POOL_BYTES:
            return False
        before = entry.nbytes
        entry.fit(layout, self.aliases)
        self.nbytes += entry.nbytes - before
        if next(reversed(self._parts)) != key:  # the most recently grown part last
            self._parts[key] = self._parts.pop(key)
        self._trim(self._parts[key])
        return True

    def _trim(self, using: list[Recycled]) -> None:
        """Forget the longest unused buffers while past the budget (their plans, if alive,
        keep their own memory): other parts' first, then this part's but the one in use."""
        while self.nbytes > POOL_BYTES:
            oldest = next(iter(self._parts))
            if self._parts[oldest] is not using:
                self._drop(oldest)
            elif len(using) > 1:
                self.nbytes -= using.pop(0).nbytes
            else:
                return

    def _drop(self, key: int) -> None:
        for entry in self._parts.pop(key, ()):
            self.nbytes -= entry.nbytes


def _unique(views: Mapping[Key, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each view once (several keys may name one, an alias or a staged source)."""
    return tuple({id(t): t for t in views.values()}.values())


def _elements(layout: FreshLayout) -> int:
    """int32 elements of a plan's buffer: what the copy sends, then the device fields."""
    return layout.part.sent + layout.device_extra


def _bytes(layout: FreshLayout) -> int:
    """What keeping memory for ``layout`` costs, at the capacities the pool rounds to."""
    total = _capacity(_elements(layout)) * 4
    return total + sum(_capacity(n) * dt.itemsize for dt, (n, _) in layout.arena_pieces.items())


def _capacity(elements: int) -> int:
    """Room for ``elements``: the next power of two, so a growing shape regrows rarely."""
    return max(_MIN_ELEMENTS, 1 << (max(elements, 1) - 1).bit_length())


def _cut(
    buffer: torch.Tensor,
    pieces: tuple[Piece, ...],
    out: dict,
) -> None:
    """Contiguous views at fixed offsets, one call each: a layout's device fields."""
    for key, offset, shape, stride in pieces:
        out[key] = buffer.as_strided(shape, stride, offset)
