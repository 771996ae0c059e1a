"""A step's inputs checked, padded and derived where they are read: on the device, one step.

The engine wrote a step's raw inputs (``planner.step_inputs``) and they moved to the device
in one transfer, unchecked. Before any op reads them, :class:`InputCheck` (recorded first in
a captured graph, run first in an eager plan):

- checks every real row against the limits and relations a batch must hold: a request adding
  more tokens than its KV length, every input within its range, extend lengths summing to the
  step's tokens, a ragged bucket's KV within its bound, no KV slot written twice, no request
  twice, given positions equal to what the lengths imply, and every token-table entry the
  plans read within the KV cache (the null request 0 and the null slot 0 may repeat);
- writes the first failure as an error word (:data:`ERROR_WORDS` int32: the refusal, the
  field, the row, the value, and what was expected), unless the word already holds one;
- writes each source field of the plans: a real row's value, the schema's pad past the real
  rows, and the pad in every row of a refused batch, so no kernel of that step reads or
  writes anything outside the null request and the null slot;
- derives the positions the engine left out from the lengths.

The engine reads the error word with the step's outputs (``GraphRunner.read``: one
device-to-host copy) and :func:`refusal` turns it into the :class:`~planner.errors.BatchError`
naming the field, the row and the value, before any output of that step is used.

Everything is torch ops without a host synchronisation, so it runs inside a CUDA graph and,
as it is, on the CPU: the same code checks eager plans, captures and replays.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from planner import device_checks_triton
from planner.batch import SOURCES
from planner.errors import BatchError
from planner.step_inputs import BATCH_FIELD, InputLayout

ERROR_WORDS = 8
"""int32 words of an error word: refusal, field, row, value, two details, the check's
``ident``, one spare."""
NULL_ENTRY = 0
"""The null request (row 0 of the token table) and the null KV slot: padding's, may repeat."""


class Refusal(enum.IntEnum):
    """Why a batch was refused, in the order the checks name them (the first failing wins)."""

    NONE = 0
    NEGATIVE_PREFIX = 1
    OUT_OF_RANGE = 2
    TOKEN_COUNT = 3
    KV_BOUND = 4
    SLOT_TWICE = 5
    REQUEST_TWICE = 6
    POSITIONS = 7
    TABLE_ENTRY = 8


FIELDS = (*SOURCES, "req_to_token")
"""The field an error word names, by index."""
_FIELD = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True)
class Bounds:
    """What a mode's inputs may hold: inclusive ``(lo, hi)`` per input, and the relations."""

    ranges: Mapping[str, tuple[int, int]]
    max_context: int
    table_width: int
    kv_slots: int | None
    tokens_given: bool
    """Extend lengths vary per request (ragged, draft extend): they must sum to the tokens."""
    kv_bound: int | None = None
    """A ragged bucket's bound on the sum of KV lengths (``Limits.kv_token_capacity``)."""


class InputCheck:
    """The device step of one mode's batches (see the module docstring), over the mode's
    raw-input layout; each call names its bucket of ``reqs`` requests and ``tokens`` tokens
    and the source fields to write, by ``(source, pad)``, each ``reqs`` or ``tokens`` long.
    Its constants (row numbers, every input word's range) are made once, at its capacity."""

    def __init__(
        self,
        layout: InputLayout,
        bounds: Bounds,
        device: torch.device,
        ident: int = 0,
        *,
        fused: bool | None = None,
        per_bucket: bool = False,
    ) -> None:
        self.layout, self.bounds, self.ident = layout, bounds, ident
        self.per_bucket = per_bucket
        """Captured buckets' checks: the fused kernels compile a block per bucket size (at the
        capture); an eager plan's compile one at the mode's capacity."""
        i32 = dict(dtype=torch.int32, device=device)
        self.ident_word = torch.tensor(ident, **i32)
        """Written into the error word, so the host finds the bounds that refused."""
        self.req_rows = torch.arange(layout.max_reqs, **i32)
        self.token_rows = torch.arange(layout.max_tokens, **i32)
        self.columns = torch.arange(bounds.table_width, **i32)
        # every input word of the region: one gather and one comparison check all ranges
        index, kind, row, lo, hi, field = [], [], [], [], [], []
        for source, start in layout.offsets.items():
            n = layout.capacity(source)
            low, high = bounds.ranges[source]
            index.append(torch.arange(start, start + n))
            kind.append(torch.full((n,), 1 if SOURCES[source] else 0))
            row.append(torch.arange(n))
            lo.append(torch.full((n,), low, dtype=torch.int64))
            hi.append(torch.full((n,), high, dtype=torch.int64))
            field.append(torch.full((n,), _FIELD[source]))
        self.index = torch.cat(index).to(device)
        self.kind = torch.cat(kind).to(device)
        self.row = torch.cat(row).to(**i32)
        self.lo, self.hi = torch.cat(lo).to(device), torch.cat(hi).to(device)
        self.field = torch.cat(field).to(**i32)
        self.is_position = self.field == _FIELD["positions"]
        self.field_ids = {name: torch.tensor(i, **i32) for name, i in _FIELD.items()}
        order = [Refusal.NEGATIVE_PREFIX] if bounds.tokens_given else []
        order += [Refusal.OUT_OF_RANGE]
        order += [Refusal.TOKEN_COUNT] if bounds.tokens_given else []
        order += [Refusal.KV_BOUND] if bounds.kv_bound is not None else []
        order += [Refusal.SLOT_TWICE, Refusal.REQUEST_TWICE, Refusal.POSITIONS]
        order += [Refusal.TABLE_ENTRY]
        self.check_codes = torch.tensor([int(r) for r in order], **i32)
        """Each check's refusal, in the order :meth:`run` appends them."""
        if fused is None:
            fused = device.type == "cuda" and device_checks_triton.available(device)
        self.fused = fused and bounds.kv_slots is not None
        """The check runs as the two Triton kernels (``planner.device_checks_triton``): by
        default on CUDA with ``Limits.kv_slots`` set (the repeated-slot pass keeps a word
        per slot); else as the torch ops of :meth:`reference`, the exact reference (the CPU
        runs it: the interpreter would be slower; its tests run the kernels there)."""
        self.scratch = {}
        if self.fused:
            self.scratch = {
                "found": torch.zeros(2 * layout.max_reqs, **i32),
                "slots": torch.zeros(bounds.kv_slots, **i32),
                "pools": torch.zeros(bounds.ranges["req_pool_indices"][1] + 1, **i32),
            }

    def run(
        self,
        region: torch.Tensor,
        reqs: int,
        tokens: int,
        table: torch.Tensor,
        error: torch.Tensor,
        outputs: Mapping[tuple[str, int], torch.Tensor],
    ) -> None:
        """Check ``region`` (the raw inputs on the device) as a batch of a bucket of ``reqs``
        requests and ``tokens`` tokens, write the error word into ``error`` unless it holds
        one, and the source fields ``outputs``: two fused kernels where they run, else
        :meth:`reference`."""
        if not self.fused or len(outputs) > device_checks_triton.OUTPUTS:
            self.reference(region, reqs, tokens, table, error, outputs)
            return
        b = self.bounds
        order = list(SOURCES)
        device_checks_triton.launch(
            region,
            reqs,
            tokens,
            table,
            error,
            [(out, order.index(source), pad) for (source, pad), out in outputs.items()],
            self.layout.offsets,
            b.ranges,
            self.scratch,
            capacity=reqs if self.per_bucket else self.layout.max_reqs,
            kv_slots=b.kv_slots,
            tokens_given=b.tokens_given,
            kv_bound=b.kv_bound,
            ident=self.ident,
        )

    def reference(
        self,
        region: torch.Tensor,
        reqs: int,
        tokens: int,
        table: torch.Tensor,
        error: torch.Tensor,
        outputs: Mapping[tuple[str, int], torch.Tensor],
    ) -> None:
        """:meth:`run` as torch ops: the exact reference, graph-safe on any device."""
        b, off = self.bounds, self.layout.offsets
        counts, given = region[0:2], region[2] != 0
        seq = region[off["seq_lens"] : off["seq_lens"] + reqs]
        ext = region[off["extend_lens"] : off["extend_lens"] + reqs]
        pool = region[off["req_pool_indices"] : off["req_pool_indices"] + reqs]
        slot = region[off["out_cache_loc"] : off["out_cache_loc"] + tokens]
        pos = region[off["positions"] : off["positions"] + tokens]
        req_rows, token_rows = self.req_rows[:reqs], self.token_rows[:tokens]
        real_r = req_rows < counts[0]
        real_t = token_rows < counts[1]
        found: list[tuple] = []  # per check: (any, field, row, value, detail, detail2)
        f = self.field_ids

        # a request adding more tokens than its KV length: named before anything else (where
        # the counts vary; a uniform batch's lower bound on seq_lens says it)
        if b.tokens_given:
            found.append(_first(real_r & (ext > seq), f["extend_lens"], ext, seq, seq))

        # ranges: every real row of every input (positions only where the engine gave them)
        values = region[self.index]
        real = (self.row < counts[self.kind]) & ~(self.is_position & ~given)
        bad = real & ((values < self.lo) | (values > self.hi))
        at = bad.to(torch.int32).argmax()
        value = _at(values, at)
        found.append((bad.any(), _at(self.field, at), _at(self.row, at), value, value, value))

        ext_real = torch.where(real_r, ext.clamp(0, tokens), 0)
        total = ext_real.sum(dtype=torch.int32)
        if b.tokens_given:
            found.append((total != counts[1], f["extend_lens"], counts[1], total, counts[1], total))
        seq_real = torch.where(real_r, seq, 0)
        if b.kv_bound is not None:
            kv = seq_real.sum(dtype=torch.int64).clamp(max=2**31 - 1).to(torch.int32)
            found.append((kv > b.kv_bound, f["seq_lens"], counts[0], kv, kv, kv))

        found.append(_repeat(slot, real_t, token_rows, f["out_cache_loc"]))
        found.append(_repeat(pool, real_r, req_rows, f["req_pool_indices"]))

        # positions the lengths imply: token t of request r is at seq[r] - ends[r] + t
        ends = torch.cumsum(ext_real, 0, dtype=torch.int32)
        owner = torch.searchsorted(ends, token_rows, right=True).clamp_(max=reqs - 1)
        implied = (seq - ends).index_select(0, owner) + token_rows
        found.append(
            _first(real_t & given & (pos != implied), f["positions"], pos, implied, implied)
        )

        # token table entries the plans read: row pool[r], columns below seq[r]
        width = b.table_width
        rows_ok = real_r & (pool >= 0) & (pool < table.shape[0])
        entries = table.index_select(0, torch.where(rows_ok, pool, NULL_ENTRY))
        used = (self.columns < seq.clamp(0, width)[:, None]) & rows_ok[:, None]
        wrong = entries < 0
        if b.kv_slots is not None:
            wrong |= entries >= b.kv_slots
        bad = (used & wrong).reshape(-1)
        at = bad.to(torch.int32).argmax()
        request = (at // width).to(torch.int32)
        column = (at % width).to(torch.int32)
        value = _at(entries.reshape(-1), at)
        found.append((bad.any(), f["req_to_token"], request, value, _at(pool, request), column))

        anys = torch.stack([check[0] for check in found])
        first = anys.to(torch.int32).argmax()
        failed = anys.any()
        codes = self.check_codes
        parts = [
            _at(torch.stack([check[i].to(torch.int32) for check in found]), first)
            for i in range(1, 6)
        ]
        code = torch.where(failed, _at(codes, first), 0)
        word = torch.where(failed, torch.stack([code, *parts, self.ident_word, code * 0]), 0)
        error.copy_(torch.where(error[0] != 0, error, word))

        ok = ~failed
        keep_r, keep_t = real_r & ok, real_t & ok
        derived = {
            "seq_lens": seq,
            "extend_lens": ext,
            "req_pool_indices": pool,
            "out_cache_loc": slot,
            "positions": torch.where(given, pos, implied),
        }
        for (source, pad), out in outputs.items():
            keep = keep_t if SOURCES[source] else keep_r
            out.copy_(torch.where(keep, derived[source], pad))


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 0-d device ``index``, without reading it on the host (plain
    indexing with a tensor scalar would: a synchronisation, refused in a graph capture)."""
    return values.index_select(0, index.reshape(1)).reshape(())


def _first(bad: torch.Tensor, field: torch.Tensor, values, detail, detail2) -> tuple:
    """The first ``bad`` row: ``(any, field, row, value, detail, detail2)``."""
    at = bad.to(torch.int32).argmax()
    return bad.any(), field, at.to(torch.int32), _at(values, at), _at(detail, at), _at(detail2, at)


def _repeat(values: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, field: torch.Tensor):
    """The first value other than the null entry that two real rows hold: ``(any, field,
    the later row, the value, the earlier row, the earlier row)``. Rows left out get
    distinct negative keys, so they never match."""
    keys = torch.where(
        real & (values != NULL_ENTRY), values.to(torch.int64), -1 - rows.to(torch.int64)
    )
    if keys.numel() < 2:
        zero = field * 0
        return zero != 0, field, zero, zero, zero, zero
    ordered, order = torch.sort(keys, stable=True)
    same = ordered[1:] == ordered[:-1]
    at = same.to(torch.int32).argmax()
    pair = order.index_select(0, torch.stack([at, at + 1]))
    later = pair.max().to(torch.int32)
    earlier = pair.min().to(torch.int32)
    return same.any(), field, later, _at(ordered, at).to(torch.int32), earlier, earlier


def refusal(word: Sequence[int], bounds: Bounds) -> BatchError | None:
    """The error a device error word names (None for a clean word), as the host checks
    named the same refusal: the field, the row, the value and the limit."""
    code, field, row, value, detail, detail2 = (int(w) for w in word[:6])
    if code == Refusal.NONE:
        return None
    what = Refusal(code)
    if what is Refusal.NEGATIVE_PREFIX:
        return BatchError(
            f"a request adds more tokens than its KV length (negative cached prefix), request {row}",
            field="extend_lens_cpu",
            expected=f"<= seq_lens_cpu[{row}] = {detail}",
            actual=value,
        )
    if what is Refusal.OUT_OF_RANGE:
        source = FIELDS[field]
        low, high = bounds.ranges[source]
        if (
            source == "seq_lens"
            and low <= value <= bounds.max_context
            and value > bounds.table_width
        ):
            return BatchError(
                f"token table narrower than the longest request (request {row})",
                field="req_to_token",
                expected=f">= {value} columns",
                actual=bounds.table_width,
            )
        return BatchError(
            f"value out of range (row {row})",
            field=BATCH_FIELD.get(source, source),
            expected=f"[{low}, {high}]",
            actual=value,
        )
    if what is Refusal.TOKEN_COUNT:
        return BatchError(
            "the extend lengths do not sum to the step's query tokens",
            field="extend_lens_cpu",
            expected=f"{detail} tokens in all",
            actual=value,
        )
    if what is Refusal.KV_BOUND:
        return BatchError(
            "KV tokens past the bound of a captured ragged batch (Limits.ragged_kv_tokens): "
            "the step runs eagerly",
            field="seq_lens_cpu",
            expected=f"<= {bounds.kv_bound} in all",
            actual=value,
        )
    if what in (Refusal.SLOT_TWICE, Refusal.REQUEST_TWICE):
        name, thing = (
            ("out_cache_loc", "a KV slot written")
            if what is Refusal.SLOT_TWICE
            else ("req_pool_indices", "a request")
        )
        return BatchError(
            f"{thing} twice in one batch (entries {detail} and {row})",
            field=name,
            expected="distinct values (0, the null entry, may repeat)",
            actual=value,
        )
    if what is Refusal.POSITIONS:
        return BatchError(
            "positions disagree with the lengths (a request of KV length L adding n tokens "
            f"holds positions L-n .. L-1); first at token {row}",
            field="positions",
            expected=detail,
            actual=value,
        )
    high = bounds.kv_slots if bounds.kv_slots is not None else 2**31
    return BatchError(
        f"token table entry outside the KV cache (req_to_token[{detail}, {detail2}], request {row})",
        field="req_to_token",
        expected=f"[0, {high - 1}]",
        actual=value,
    )
