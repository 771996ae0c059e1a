"""Host twins of the generic metadata ops: the references' semantics over numpy arrays.

An eager plan's per-request and per-token arithmetic (lengths, prefix sums,
offsets, clamps) reads only inputs that start on the host. Launching a kernel
for each costs 20-40 us of host time on a GPU, far more than the arithmetic;
numpy does each in about a microsecond, straight into the staging buffer, and
the results ride the one host-to-device copy the inputs needed anyway.

Each twin writes exactly what its torch reference writes, int32 wrapping
included (tests compare them on random inputs). The planner hands them arrays
laid out to the plan's spec, so they repeat none of the references' argument
checks. Ops that read device data (the token table) have no twin.
"""

from __future__ import annotations

import numpy as np

from backends.common import ops, ragged_ops

I32 = np.int32


@ops.cumsum_with_zero.host_twin()
def cumsum_with_zero(out: np.ndarray, x: np.ndarray) -> None:
    out[0] = 0
    np.cumsum(x, dtype=I32, out=out[1:])


@ops.clamp.host_twin()
def clamp_into(out: np.ndarray, x: np.ndarray, lo: int | None, hi: int | None) -> None:
    # maximum, then minimum: lo > hi gives hi, as torch.clamp does. The ufuncs directly:
    # np.clip's dispatch costs about 4x the arithmetic on a batch-sized array.
    if lo is None and hi is None:
        out[:] = x
    elif lo is None:
        np.minimum(x, hi, out=out)
    else:
        np.maximum(x, lo, out=out)
        if hi is not None:
            np.minimum(out, hi, out=out)


_RAMPS: dict[int, np.ndarray] = {}


def _ramp(n: int) -> np.ndarray:
    """``arange(n)`` as int32, kept per length (batch sizes repeat every step)."""
    ramp = _RAMPS.get(n)
    if ramp is None:
        if len(_RAMPS) >= 1024:
            _RAMPS.clear()
        ramp = _RAMPS[n] = np.arange(n, dtype=I32)
    return ramp


@ops.uniform_offsets.host_twin()
def uniform_offsets(out: np.ndarray, step: int) -> None:
    np.multiply(_ramp(out.shape[0]), I32(step), out=out)


@ops.causal_lengths.host_twin()
def causal_lengths(out: np.ndarray, seq_lens: np.ndarray, next_n: int) -> None:
    back = np.arange(next_n - 1, -1, -1, dtype=I32)
    np.subtract(seq_lens[:, None], back, out=out.reshape(seq_lens.shape[0], next_n))


def _owner(n: int, indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(t, b, real)`` as ``ragged_ref._token_owner``: the request owning each of ``n``
    tokens (clamped into range, so gathers stay in bounds for padding) and whether the
    token is real. Callers handle ``reqs == 0``."""
    reqs = indptr.shape[0] - 1
    t = np.arange(n, dtype=I32)
    b = np.searchsorted(indptr[1:], t, side="right").astype(I32)
    np.minimum(b, reqs - 1, out=b)
    return t, b, t < indptr[reqs]


def _positions(n: int, qo_indptr: np.ndarray, seq_lens: np.ndarray):
    t, b, real = _owner(n, qo_indptr)
    return seq_lens[b] - qo_indptr[b + 1] + t, real


@ragged_ops.token_request.host_twin()
def token_request(out: np.ndarray, qo_indptr: np.ndarray, pad: int) -> None:
    if qo_indptr.shape[0] == 1:
        out.fill(pad)
        return
    _, b, real = _owner(out.shape[0], qo_indptr)
    out[:] = np.where(real, b, I32(pad))


def _per_position(out: np.ndarray, qo_indptr: np.ndarray, seq_lens: np.ndarray, of, pad: int):
    """``out[t] = of(position)`` for real tokens, ``pad`` for padding (and every token of an
    empty batch): the shape the per-token length ops share."""
    if qo_indptr.shape[0] == 1:
        out.fill(pad)
        return
    pos, real = _positions(out.shape[0], qo_indptr, seq_lens)
    out[:] = np.where(real, of(pos), I32(pad))


@ragged_ops.token_positions.host_twin()
def token_positions(out: np.ndarray, qo_indptr: np.ndarray, seq_lens: np.ndarray) -> None:
    _per_position(out, qo_indptr, seq_lens, lambda pos: pos, 0)


@ragged_ops.token_causal_lengths.host_twin()
def token_causal_lengths(out: np.ndarray, qo_indptr: np.ndarray, seq_lens: np.ndarray) -> None:
    _per_position(out, qo_indptr, seq_lens, lambda pos: pos + I32(1), 1)


@ragged_ops.token_topk_lengths.host_twin()
def token_topk_lengths(
    out: np.ndarray, qo_indptr: np.ndarray, seq_lens: np.ndarray, topk: int
) -> None:
    _per_position(out, qo_indptr, seq_lens, lambda pos: np.minimum(pos + I32(1), I32(topk)), 1)


@ragged_ops.token_kv_ranges.host_twin()
def token_kv_ranges(out: np.ndarray, qo_indptr: np.ndarray, kv_indptr: np.ndarray) -> None:
    if qo_indptr.shape[0] == 1:
        out[0].fill(0)
        out[1].fill(1)
        return
    t, b, real = _owner(out.shape[1], qo_indptr)
    ends = kv_indptr[b + 1] - qo_indptr[b + 1]
    out[0] = np.where(real, kv_indptr[b], I32(0))
    out[1] = np.where(real, ends + t + I32(1), I32(1))


@ragged_ops.last_token_rows.host_twin()
def last_token_rows(out: np.ndarray, qo_indptr: np.ndarray) -> None:
    np.subtract(qo_indptr[1:], I32(1), out=out)


@ragged_ops.slot_pages.host_twin()
def slot_pages(out: np.ndarray, out_cache_loc: np.ndarray, page_size: int) -> None:
    np.floor_divide(out_cache_loc, I32(page_size), out=out[0])
    np.remainder(out_cache_loc, I32(page_size), out=out[1])
