"""The device check (``planner.device_checks``) as two Triton kernels: its GPU provider.

The torch ops of :class:`~planner.device_checks.InputCheck` are the exact reference; as torch
ops they are about a hundred small kernels, which cost the host a launch each in an eager plan
and the GPU a kernel each in a graph. Here the same check is two launches:

- ``_table_rows`` (one program per request): the first token-table entry outside the KV cache
  in each request's row, into a scratch pair per request;
- ``_check`` (one program): ranges, the negative prefix, the token count, the KV bound,
  repeated slots and requests, positions against the lengths, the table rows' findings, the
  error word, and every source field (the value, the pad past the real rows, the pad
  everywhere in a refused batch).

Repeated values are found in one pass each way: every real row writes its index at its value
in a scratch array (slots: ``kv_slots`` words; requests: the token table's rows), and a row
that reads back another index shares its value. A token's request, for the positions, is
the last real request starting at or before it. The error word
and the fields equal the reference's bit for bit (``tests/planner/test_device_check_triton.py``
under ``TRITON_INTERPRET=1``, and on the GPU).

Triton is imported on the first launch, so importing the planner core loads no Triton.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

tl: Any = None
"""``triton.language``, once :func:`kernels` has loaded it (the kernels' bodies name it)."""
_keep_first: Any = None
_first_outside: Any = None
"""``_keep_first_py`` and ``_first_outside_py`` under ``triton.jit`` for the interpreter
mode of the last :func:`kernels` call (``_check`` calls them by these names)."""
_jitted: dict[bool, tuple[Any, ...]] = {}
BIG = 2**30
"""No row: larger than any row or value index a check compares (a constexpr of both
kernels: Triton reads no plain module global)."""
OUTPUTS = 8
"""Source fields one launch writes at most (a mode's distinct ``(source, pad)`` pairs)."""
BLOCK_T = 128
"""Tokens per step of the check's loops (the positions' step holds ``BLOCK_T x BLOCK_R``)."""
BLOCK_W = 1024
"""Token-table columns per step of a request's row scan."""


def launch(
    region: torch.Tensor,
    reqs: int,
    tokens: int,
    table: torch.Tensor,
    error: torch.Tensor,
    outputs: list[tuple[torch.Tensor, int, int]],
    offsets: dict[str, int],
    ranges: dict[str, tuple[int, int]],
    scratch: dict[str, torch.Tensor],
    *,
    capacity: int,
    kv_slots: int,
    tokens_given: bool,
    kv_bound: int | None,
    ident: int,
) -> None:
    """The check of ``region`` for a bucket of ``reqs`` requests and ``tokens`` tokens:
    ``outputs`` as ``(field, source index, pad)``; ``capacity``: the most requests the
    compiled block holds (``reqs`` or more)."""
    table_rows, check = kernels()
    found = scratch["found"]
    table_rows[(reqs,)](
        region,
        table,
        found,
        reqs,
        offsets["seq_lens"],
        offsets["req_pool_indices"],
        table.shape[0],
        table.stride(0),
        table.shape[1],
        kv_slots,
        BLOCK=BLOCK_W,
        BIG=BIG,
    )
    base = min(outputs, key=lambda o: o[0].data_ptr())[0]
    spots = [((t.data_ptr() - base.data_ptr()) // 4, source, pad) for t, source, pad in outputs]
    spots += [(0, 0, 0)] * (OUTPUTS - len(spots))
    o, s, p = zip(*spots)
    # the block holds the bucket's requests in a captured graph (compiled at its capture),
    # the mode's capacity in an eager plan (one variant, whatever the batch: compiled once, at
    # the engine's warm-up, never mid-serving)
    block_r = max(16, 1 << (capacity - 1).bit_length())
    check[(1,)](
        region,
        found,
        error,
        scratch["slots"],
        scratch["pools"],
        base,
        reqs,
        tokens,
        offsets["seq_lens"],
        offsets["extend_lens"],
        offsets["req_pool_indices"],
        offsets["out_cache_loc"],
        offsets["positions"],
        *ranges["seq_lens"],
        *ranges["extend_lens"],
        *ranges["req_pool_indices"],
        *ranges["out_cache_loc"],
        *ranges["positions"],
        kv_bound if kv_bound is not None else 0,
        ident,
        *o,
        *s,
        *p,
        TOKENS_GIVEN=tokens_given,
        KV_BOUND=kv_bound is not None,
        N_OUT=len(outputs),
        BLOCK_R=block_r,
        BLOCK_T=max(16, min(BLOCK_T, 16384 // block_r)),
        BIG=BIG,
    )


def _table_rows(
    region_ptr,
    table_ptr,
    found_ptr,
    reqs,
    o_seq,
    o_pool,
    table_rows,
    table_stride,
    width,
    kv_slots,
    BLOCK: tl.constexpr,  # noqa: N803
    BIG: tl.constexpr,  # noqa: N803
):
    """Request ``r``'s row: the first column below its length whose entry is outside
    ``[0, kv_slots)``, and the entry; ``(-1, 0)`` where none is (or the row is not real)."""
    r = tl.program_id(0)
    n_req = tl.load(region_ptr)
    seq = tl.load(region_ptr + o_seq + r)
    pool = tl.load(region_ptr + o_pool + r)
    ok = (r < n_req) & (pool >= 0) & (pool < table_rows)
    limit = tl.where(ok, tl.minimum(tl.maximum(seq, 0), width), 0)
    row = tl.where(ok, pool, 0).to(tl.int64)
    first = seq * 0 + BIG
    for start in range(0, width, BLOCK):
        col = start + tl.arange(0, BLOCK)
        used = col < limit
        entry = tl.load(table_ptr + row * table_stride + col, mask=used, other=0)
        bad = used & ((entry < 0) | (entry >= kv_slots))
        first = tl.minimum(first, tl.min(tl.where(bad, col, BIG), axis=0))
    has = first < BIG
    at = tl.where(has, first, 0)
    value = tl.load(table_ptr + row * table_stride + at, mask=has, other=0)
    tl.store(found_ptr + r, tl.where(has, first, -1))
    tl.store(found_ptr + reqs + r, tl.where(has, value, 0))


def _keep_first_py(code, field, row, value, d1, d2, found, c, f, at, v, a, b):
    """Refusal ``c`` (field ``f``, row ``at``, value ``v``, details ``a`` and ``b``) where
    ``found`` and no refusal is kept yet: the check tries its refusals in the reference's
    order and keeps the first. Under ``triton.jit`` as ``_keep_first`` (:func:`kernels`)."""
    take = (code == 0) & found
    return (
        tl.where(take, c, code),
        tl.where(take, f, field),
        tl.where(take, at, row),
        tl.where(take, v, value),
        tl.where(take, a, d1),
        tl.where(take, b, d2),
    )


def _first_outside_py(x, lo, hi, real, r, BIG: tl.constexpr):  # noqa: N803
    """The first real row whose ``x`` lies outside ``[lo, hi]`` (``BIG`` if none) and its
    value. Under ``triton.jit`` as ``_first_outside`` (:func:`kernels`)."""
    at = tl.min(tl.where(real & ((x < lo) | (x > hi)), r, BIG), axis=0)
    return at, tl.sum(tl.where(r == at, x, 0), axis=0)


def _check(
    region_ptr,
    found_ptr,
    error_ptr,
    slot_seen_ptr,
    pool_seen_ptr,
    out_ptr,
    reqs,
    tokens,
    o_seq,
    o_ext,
    o_pool,
    o_slot,
    o_pos,
    lo_seq,
    hi_seq,
    lo_ext,
    hi_ext,
    lo_pool,
    hi_pool,
    lo_slot,
    hi_slot,
    lo_pos,
    hi_pos,
    kv_bound,
    ident,
    o0,
    o1,
    o2,
    o3,
    o4,
    o5,
    o6,
    o7,
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    TOKENS_GIVEN: tl.constexpr,  # noqa: N803
    KV_BOUND: tl.constexpr,  # noqa: N803
    N_OUT: tl.constexpr,  # noqa: N803
    BLOCK_R: tl.constexpr,  # noqa: N803
    BLOCK_T: tl.constexpr,  # noqa: N803
    BIG: tl.constexpr,  # noqa: N803
):
    """The whole check of one region but the table rows' scan: see the module docstring.
    Source field ``k < N_OUT`` starts ``o<k>`` int32 words from ``out_ptr``, holds source
    ``s<k>`` (``SOURCES`` order) and pads with ``p<k>``."""
    n_req = tl.load(region_ptr)
    n_tok = tl.load(region_ptr + 1)
    given = tl.load(region_ptr + 2) != 0
    r = tl.arange(0, BLOCK_R)
    rm = r < reqs
    real_r = rm & (r < n_req)
    seq = tl.load(region_ptr + o_seq + r, mask=rm, other=0)
    ext = tl.load(region_ptr + o_ext + r, mask=rm, other=0)
    pool = tl.load(region_ptr + o_pool + r, mask=rm, other=0)
    zero = n_req * 0
    code = zero  # the refusal kept so far (0: none), its field, row, value and details
    field = zero
    row = zero
    value = zero
    d1 = zero
    d2 = zero

    # 1. a request adding more tokens than its KV length
    if TOKENS_GIVEN:
        at = tl.min(tl.where(real_r & (ext > seq), r, BIG), axis=0)
        s = tl.sum(tl.where(r == at, seq, 0), axis=0)
        e = tl.sum(tl.where(r == at, ext, 0), axis=0)
        code, field, row, value, d1, d2 = _keep_first(
            code, field, row, value, d1, d2, at < BIG, 1, 1, at, e, s, s
        )

    # 2. ranges, in the layout's (``SOURCES``) order: seq_lens, extend_lens, req_pool_indices,
    # positions, out_cache_loc
    at, v = _first_outside(seq, lo_seq, hi_seq, real_r, r, BIG)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, at < BIG, 2, 0, at, v, v, v
    )
    at, v = _first_outside(ext, lo_ext, hi_ext, real_r, r, BIG)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, at < BIG, 2, 1, at, v, v, v
    )
    at, v = _first_outside(pool, lo_pool, hi_pool, real_r, r, BIG)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, at < BIG, 2, 2, at, v, v, v
    )
    bad_slot = BIG + zero
    bad_pos = BIG + zero
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        real_t = (t < tokens) & (t < n_tok)
        slot = tl.load(region_ptr + o_slot + t, mask=t < tokens, other=0)
        pos = tl.load(region_ptr + o_pos + t, mask=t < tokens, other=0)
        out = real_t & ((slot < lo_slot) | (slot > hi_slot))
        bad_slot = tl.minimum(bad_slot, tl.min(tl.where(out, t, BIG), axis=0))
        out = real_t & given & ((pos < lo_pos) | (pos > hi_pos))
        bad_pos = tl.minimum(bad_pos, tl.min(tl.where(out, t, BIG), axis=0))
    v = tl.load(region_ptr + o_pos + tl.where(bad_pos < BIG, bad_pos, 0))
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, bad_pos < BIG, 2, 3, bad_pos, v, v, v
    )
    v = tl.load(region_ptr + o_slot + tl.where(bad_slot < BIG, bad_slot, 0))
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, bad_slot < BIG, 2, 4, bad_slot, v, v, v
    )

    # 3. extend lengths summing to the tokens; 4. a ragged bucket's KV bound
    ext_real = tl.where(real_r, tl.minimum(tl.maximum(ext, 0), tokens), 0)
    if TOKENS_GIVEN:
        total = tl.sum(ext_real, axis=0)
        code, field, row, value, d1, d2 = _keep_first(
            code, field, row, value, d1, d2, total != n_tok, 3, 1, n_tok, total, n_tok, total
        )
    if KV_BOUND:
        kv = tl.sum(tl.where(real_r, seq, 0).to(tl.int64), axis=0)
        kv = tl.minimum(kv, 2**31 - 1).to(tl.int32)
        code, field, row, value, d1, d2 = _keep_first(
            code, field, row, value, d1, d2, kv > kv_bound, 4, 0, n_req, kv, kv, kv
        )

    # 5. a KV slot written twice: each real slot's token written at the slot, read back
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(region_ptr + o_slot + t, mask=t < tokens, other=0)
        mine = (t < tokens) & (t < n_tok) & (slot != 0) & (slot >= lo_slot) & (slot <= hi_slot)
        tl.store(slot_seen_ptr + slot, t, mask=mine)
    tl.debug_barrier()
    twice = BIG + zero
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(region_ptr + o_slot + t, mask=t < tokens, other=0)
        mine = (t < tokens) & (t < n_tok) & (slot != 0) & (slot >= lo_slot) & (slot <= hi_slot)
        seen = tl.load(slot_seen_ptr + slot, mask=mine, other=0)
        twice = tl.minimum(twice, tl.min(tl.where(mine & (seen != t), slot, BIG), axis=0))
    first = BIG + zero
    second = BIG + zero
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(region_ptr + o_slot + t, mask=t < tokens, other=0)
        same = (t < tokens) & (t < n_tok) & (slot == twice)
        first = tl.minimum(first, tl.min(tl.where(same, t, BIG), axis=0))
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(region_ptr + o_slot + t, mask=t < tokens, other=0)
        same = (t < tokens) & (t < n_tok) & (slot == twice) & (t != first)
        second = tl.minimum(second, tl.min(tl.where(same, t, BIG), axis=0))
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, twice < BIG, 5, 4, second, twice, first, first
    )

    # 6. a request twice: the same with the pool rows
    mine = real_r & (pool != 0) & (pool >= lo_pool) & (pool <= hi_pool)
    tl.store(pool_seen_ptr + pool, r, mask=mine)
    tl.debug_barrier()
    seen = tl.load(pool_seen_ptr + pool, mask=mine, other=0)
    twice = tl.min(tl.where(mine & (seen != r), pool, BIG), axis=0)
    first = tl.min(tl.where(real_r & (pool == twice), r, BIG), axis=0)
    second = tl.min(tl.where(real_r & (pool == twice) & (r != first), r, BIG), axis=0)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, twice < BIG, 6, 2, second, twice, first, first
    )

    # 7. positions: token t's request is the last real one starting at or before t; token
    # t of request q is at seq[q] - ends[q] + t
    ends = tl.cumsum(ext_real, axis=0)
    starts = ends - ext_real
    base = seq - ends
    opens = real_r & (ext_real > 0)
    bad_at = BIG + zero
    for start in range(0, tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        tm = t < tokens
        before = (starts[None, :] <= t[:, None]) & opens[None, :]
        owner = tl.maximum(tl.sum(before.to(tl.int32), axis=1) - 1, 0)
        implied = tl.sum(tl.where(owner[:, None] == r[None, :], base[None, :], 0), axis=1) + t
        pos = tl.load(region_ptr + o_pos + t, mask=tm, other=0)
        bad = tm & (t < n_tok) & given & (pos != implied)
        bad_at = tl.minimum(bad_at, tl.min(tl.where(bad, t, BIG), axis=0))
    safe = tl.where(bad_at < BIG, bad_at, 0)
    q = tl.maximum(tl.sum(((starts <= safe) & opens).to(tl.int32), axis=0) - 1, 0)
    want = tl.sum(tl.where(r == q, base, 0), axis=0) + safe
    got = tl.load(region_ptr + o_pos + safe)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, bad_at < BIG, 7, 3, bad_at, got, want, want
    )

    # 8. the token table rows' first bad entries (``_table_rows``)
    col = tl.load(found_ptr + r, mask=rm, other=-1)
    at = tl.min(tl.where(rm & (col >= 0), r, BIG), axis=0)
    entry = tl.load(found_ptr + reqs + r, mask=rm, other=0)
    v = tl.sum(tl.where(r == at, entry, 0), axis=0)
    p = tl.sum(tl.where(r == at, pool, 0), axis=0)
    c = tl.sum(tl.where(r == at, col, 0), axis=0)
    code, field, row, value, d1, d2 = _keep_first(
        code, field, row, value, d1, d2, at < BIG, 8, 5, at, v, p, c
    )

    # the error word, unless one is there; then the source fields
    old = tl.load(error_ptr)
    keep_old = old != 0
    tl.store(error_ptr + 1, tl.where(keep_old, tl.load(error_ptr + 1), field))
    tl.store(error_ptr + 2, tl.where(keep_old, tl.load(error_ptr + 2), row))
    tl.store(error_ptr + 3, tl.where(keep_old, tl.load(error_ptr + 3), value))
    tl.store(error_ptr + 4, tl.where(keep_old, tl.load(error_ptr + 4), d1))
    tl.store(error_ptr + 5, tl.where(keep_old, tl.load(error_ptr + 5), d2))
    tl.store(
        error_ptr + 6, tl.where(keep_old, tl.load(error_ptr + 6), tl.where(code != 0, ident, 0))
    )
    tl.store(error_ptr + 7, tl.where(keep_old, tl.load(error_ptr + 7), 0))
    tl.store(error_ptr, tl.where(keep_old, old, code))
    ok = code == 0
    for k in tl.static_range(N_OUT):
        if k == 0:
            offset, source, pad = o0, s0, p0
        elif k == 1:
            offset, source, pad = o1, s1, p1
        elif k == 2:
            offset, source, pad = o2, s2, p2
        elif k == 3:
            offset, source, pad = o3, s3, p3
        elif k == 4:
            offset, source, pad = o4, s4, p4
        elif k == 5:
            offset, source, pad = o5, s5, p5
        elif k == 6:
            offset, source, pad = o6, s6, p6
        else:
            offset, source, pad = o7, s7, p7
        per_req = tl.where(source == 0, seq, tl.where(source == 1, ext, pool))
        per_req_source = (r * 0 + source) < 3  # a block: the interpreter takes no scalar mask
        tl.store(
            out_ptr + offset + r, tl.where(real_r & ok, per_req, pad), mask=rm & per_req_source
        )
        for start in range(0, tokens, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            tm = (t < tokens) & ((t * 0 + source) >= 3)
            keep = tm & (t < n_tok) & ok
            slot = tl.load(region_ptr + o_slot + t, mask=tm, other=0)
            before = (starts[None, :] <= t[:, None]) & opens[None, :]
            owner = tl.maximum(tl.sum(before.to(tl.int32), axis=1) - 1, 0)
            implied = tl.sum(tl.where(owner[:, None] == r[None, :], base[None, :], 0), axis=1) + t
            pos = tl.load(region_ptr + o_pos + t, mask=tm, other=0)
            per_token = tl.where(source == 4, slot, tl.where(given, pos, implied))
            tl.store(out_ptr + offset + t, tl.where(keep, per_token, pad), mask=tm)


def kernels() -> tuple[Any, Any]:
    """The two kernels under ``triton.jit``, decorated on first use per interpreter mode."""
    global tl
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
    knobs = getattr(triton, "knobs", None)
    interpret = bool(knobs.runtime.interpret) if knobs is not None else False
    global _keep_first, _first_outside
    found = _jitted.get(interpret)
    if found is None:
        found = _jitted[interpret] = (
            *(triton.jit(fn, **_unspecialised(triton, fn)) for fn in (_table_rows, _check)),
            triton.jit(_keep_first_py),
            triton.jit(_first_outside_py),
        )
    _keep_first, _first_outside = found[2:]  # this mode's helpers, found by name in _check
    return found[0], found[1]


def _unspecialised(triton: Any, fn: Any) -> dict[str, list[str]]:
    """Compile one variant whatever the sizes, offsets and bounds are (Triton specialises an
    int on being 1 or a multiple of 16, a pointer on its alignment): a batch of a new shape
    must not compile mid-serving."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    keywords = {
        "do_not_specialize": [n for n in names if not n.endswith("_ptr") and not n.isupper()]
    }
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        keywords["do_not_specialize_on_alignment"] = [n for n in names if n.endswith("_ptr")]
    return keywords


def available(device: torch.device) -> bool:
    """Whether the kernels can run for ``device``: Triton importable, and a CUDA device (or
    the interpreter, for tests)."""
    try:
        triton = importlib.import_module("triton")
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    interpret = bool(knobs.runtime.interpret) if knobs is not None else False
    return device.type == "cuda" or interpret
