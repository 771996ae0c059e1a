"""The compiled staging screen's side in Python: what it reads of a layout and a batch.

``StagingLayout.fill`` then ``check`` cost about 20 us of numpy calls per replay; the C
screen (``planner/native/stage_screen.c``) does both in one call for the batches a
replay sees (uniform: decode, verify, a draft decode's steps; host lengths), and says
"not mine" for anything else or anything wrong, after which the Python path runs and
names the field. This module turns a layout and its ranges into the screen's segment
table once (cached per ranges object, as the layout's bounds are), and a batch into
the kinds and addresses of its five sources per call.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import torch

from planner import native
from planner.batch import ForwardBatch

_SOURCE_ORDER = ("seq_lens", "extend_lens", "req_pool_indices", "out_cache_loc", "positions")
K_I32, K_I64, K_DEVICE, K_CONST, K_DERIVED = 1, 2, 3, 4, 5
"""The screen's source kinds (``planner/native/stage_screen.c``'s ``K_*``)."""
_INT32, _INT64 = torch.int32, torch.int64
_TABLES_KEPT = 16
_ARGS = struct.Struct("=19q")
"""The screen's packed arguments (``A_*`` in the C source): the segment table and its rows,
five kinds, five addresses, the region's and the batch's counts, next_n, the scratch."""
_PER_CALL = struct.Struct("=12q")
_PER_CALL_AT = 4 * 8
"""What a :class:`BoundScreen` packs per call: ``A_KIND + 2`` (the pool's kind) to
``A_REAL_TOKENS``, the rest of the arguments packed once when it is bound."""


class StageScreen:
    """The C screen bound to one layout: a segment table per ranges, a hash-set scratch.

    ``segments`` are the layout's, in its order (the first of each source is the one the
    relation checks read, as in Python); ``capacity`` bounds what one region holds.
    """

    def __init__(self, fn, segments, capacity: int) -> None:
        self.fn = fn
        self.segments = tuple(segments)
        size = 16
        while size < 2 * capacity:
            size <<= 1
        self.scratch = np.empty(size, dtype=np.int32)
        self._scratch = (self.scratch.ctypes.data, size)
        self._args = ctypes.create_string_buffer(_ARGS.size)
        self._args_address = ctypes.addressof(self._args)
        self._tables: dict[int, tuple[np.ndarray, int, int, object]] = {}

    @classmethod
    def for_layout(cls, segments, capacity: int) -> StageScreen | None:
        fn = native.stage_screen()
        return None if fn is None else cls(fn, segments, capacity)

    def _table(self, ranges) -> tuple[np.ndarray, int, int, object]:
        table = self._tables.get(id(ranges))
        if table is None:
            rows = [
                (
                    _SOURCE_ORDER.index(seg.source),
                    seg.offset,
                    int(seg.per_token),
                    seg.capacity,
                    seg.pad,
                    *ranges[seg.source],
                )
                for seg in self.segments
            ]
            array = np.ascontiguousarray(rows, dtype=np.int64)
            if len(self._tables) >= _TABLES_KEPT:
                del self._tables[next(iter(self._tables))]
            # ranges kept alive with its table: its id is the key
            table = self._tables[id(ranges)] = (array, array.ctypes.data, len(rows), ranges)
        return table

    def bind(self, ranges, reqs: int, tokens: int, next_n: int) -> BoundScreen:
        """The screen for one captured size: ranges, region counts and ``next_n`` fixed."""
        return BoundScreen(self, ranges, reqs, tokens, next_n)

    def run(
        self,
        host_address: int,
        batch: ForwardBatch,
        reqs: int,
        tokens: int,
        ranges,
        *,
        read_device: bool,
    ) -> list | None:
        """Fill and check one region at ``host_address`` (int32, the layout's size): the
        device-resident inputs left to copy, as ``StagingLayout.fill`` returns them, when
        the screen passed it; None when the Python path must run (the region may then hold
        part of a fill, which that path rewrites)."""
        if batch.extend_lens_cpu is not None or batch.extend_lens is not None:
            return None  # ragged or given lengths: the Python path's prefix check
        real = batch.seq_lens_cpu.shape[0]
        n = batch.next_n
        real_tokens = real * n
        seq = _source(batch.seq_lens_cpu, real, read_device)
        pool = _source(batch.req_pool_indices, real, read_device)
        slot = _source(batch.out_cache_loc, real_tokens, read_device)
        if seq is None or pool is None or slot is None or seq[0] == K_DEVICE:
            return None
        if batch.positions is None:
            pos = (K_DERIVED, 0)
        else:
            pos = _source(batch.positions, real_tokens, read_device)
            if pos is None:
                return None
        array, address, count, _ = self._table(ranges)
        _ARGS.pack_into(
            self._args,
            0,
            address,
            count,
            seq[0],
            K_CONST,
            pool[0],
            slot[0],
            pos[0],
            seq[1],
            n,
            pool[1],
            slot[1],
            pos[1],
            reqs,
            tokens,
            real,
            real_tokens,
            n,
            *self._scratch,
        )
        status = self.fn(host_address, self._args_address)
        if status != 0:
            return None
        if K_DEVICE not in (pool[0], slot[0], pos[0]):
            return []
        device = {
            "req_pool_indices": batch.req_pool_indices if pool[0] == K_DEVICE else None,
            "out_cache_loc": batch.out_cache_loc if slot[0] == K_DEVICE else None,
            "positions": batch.positions if pos[0] == K_DEVICE else None,
        }
        return [
            (seg, device[seg.source]) for seg in self.segments if device.get(seg.source) is not None
        ]


def _source(tensor: torch.Tensor, length: int, read_device: bool) -> tuple[int, int] | None:
    """A source's kind and address, or None where the screen cannot read it as it is."""
    if tensor.shape[0] != length or not tensor.is_contiguous():
        return None
    if not tensor.is_cpu:
        return (K_DEVICE, 0) if tensor.is_cuda and not read_device else None
    dtype = tensor.dtype
    if dtype is _INT32:
        return K_I32, tensor.data_ptr()
    if dtype is _INT64:
        return K_I64, tensor.data_ptr()
    return None


class BoundScreen:
    """A :class:`StageScreen` with one captured size's constant arguments packed once (the
    segment table, the region's counts, ``next_n``, the scratch): a replay packs only the
    batch's kinds, addresses and real counts. Its caller has read the sources' kinds and
    addresses (``planner.replay_lane``: the door's checks and these reads in one pass)."""

    __slots__ = ("fn", "_args", "_address", "_n", "_reqs", "_tokens", "_alive")

    def __init__(self, screen: StageScreen, ranges, reqs: int, tokens: int, next_n: int) -> None:
        array, address, count, _ = screen._table(ranges)
        self.fn = screen.fn
        self._args = ctypes.create_string_buffer(_ARGS.size)
        self._address = ctypes.addressof(self._args)
        self._n, self._reqs, self._tokens = next_n, reqs, tokens
        self._alive = (screen, array, ranges)  # the table and scratch it points at
        _ARGS.pack_into(
            self._args, 0, address, count, K_I32, K_CONST, *([0] * 12), next_n, *screen._scratch
        )

    def pack(
        self,
        seq: int,
        pool_kind: int,
        pool: int,
        slot_kind: int,
        slot: int,
        pos_kind: int,
        pos: int,
        real: int,
    ) -> int:
        """Pack one batch's host sources (int32 lengths at ``seq``; kinds ``K_I32`` /
        ``K_I64`` / ``K_DERIVED``) into the arguments; their address, for
        ``fp_stage_screen`` or a call that runs it first (``native.screen_and_pass``)."""
        n = self._n
        _PER_CALL.pack_into(
            self._args,
            _PER_CALL_AT,
            pool_kind,
            slot_kind,
            pos_kind,
            seq,
            n,
            pool,
            slot,
            pos,
            self._reqs,
            self._tokens,
            real,
            real * n,
        )
        return self._address

    def run(
        self,
        host_address: int,
        seq: int,
        pool_kind: int,
        pool: int,
        slot_kind: int,
        slot: int,
        pos_kind: int,
        pos: int,
        real: int,
    ) -> bool:
        """Fill and check one region at ``host_address`` from the host sources :meth:`pack`
        takes: whether it passed. When it did not, the region may hold part of a fill,
        which the general path rewrites."""
        address = self.pack(seq, pool_kind, pool, slot_kind, slot, pos_kind, pos, real)
        return self.fn(host_address, address) == 0
