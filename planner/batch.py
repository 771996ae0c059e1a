"""The forward batch a scheduler hands the planner, its modes, and the names of its inputs.

A plain frozen dataclass rather than a pydantic model: one is built every
step on the hot path, and the planner checks it itself at the door
(``planner.checks``) with messages that name the field and the limit.

A draft-decode batch is ``k`` decode batches, one KV token longer each: upstream engines
plan these once per batch for all steps, and planning them per step from lengths the
engine recomputes by hand is where off-by-ones creep in. Here the engine hands over one
batch shaped like a verify (``next_n = k`` tokens per request, KV lengths after the last
step, every step's slot) and :func:`step_batches` derives the steps: step ``s`` of request
``b`` has KV length ``seq_lens[b] - (k - 1 - s)``, slot and position of token ``b * k + s``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch


class ForwardMode(str, enum.Enum):
    """What a batch's forward computes.

    - ``decode``: one new token per request (full CUDA graph);
    - ``target_verify``: ``next_n`` tokens per request to verify (full graph);
    - ``idle``: no request at all, for a data-parallel rank with no work; it replays,
      every row padding, the graph of its declared shape (``ForwardBatch.idle_as``:
      decode, or its peers' verify, draft extend or draft decode);
    - ``extend``: new tokens after an optional cached prefix, a different number
      per request (prefill, chunked prefill); a full graph per (requests, tokens)
      bucket, eager past the stated bounds (``Limits.ragged_kv_tokens``, ``max_tokens``);
    - ``mixed``: extend and decode (or verify) requests in one batch (a decode request is
      an extend of one token, a verify request one of ``next_n``); captured like extend.
      Its logits are the last ``next_n`` rows of every request (:data:`LOGIT_ROWS_MODES`).
    - ``draft_extend``: the draft model catches up on each request's accepted
      tokens (1..``next_n``, a different number per request), padded to
      ``next_n`` rows per request so shapes stay static (full graph);
    - ``draft_decode``: ``k`` draft steps of one token per request, each one
      KV token longer than the last; planned as ``k`` decode plans in one
      planner call (full graph).
    """

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    IDLE = "idle"
    EXTEND = "extend"
    MIXED = "mixed"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"

    @property
    def ragged(self) -> bool:
        """Whether requests add different numbers of tokens (the ``tokens`` dimension is free)."""
        return self in RAGGED_MODES

    @property
    def plans_as(self) -> ForwardMode:
        """The mode whose program plans this one; idle's is decode unless a batch declares
        another shape (:attr:`ForwardBatch.plans_as`)."""
        return ForwardMode.DECODE if self is ForwardMode.IDLE else self

    @property
    def stepped(self) -> bool:
        """Whether a batch of this mode is planned as several steps (draft decode: ``k``)."""
        return self is ForwardMode.DRAFT_DECODE

    @property
    def padded_rows(self) -> bool:
        """Whether rows past a request's own token count are padding (draft extend)."""
        return self is ForwardMode.DRAFT_EXTEND


RAGGED_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.MIXED})
DECODE_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE})
"""What a plan schema plans unless it says otherwise: the target model's uniform batches."""
UNIFORM_MODES = DECODE_MODES | {ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE}
"""Every request has the same number of query rows: shapes are static per batch size."""
VERIFY_ROWS_MODES = frozenset({ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})
"""Modes with ``next_n`` query rows per request (the limits' ``next_n``); others have one."""
LOGIT_ROWS_MODES = frozenset({ForwardMode.MIXED})
"""Ragged modes whose LM head reads the last ``next_n`` rows of every request (the limits'
``next_n``; one row when not speculating): a mixed batch holds verify rows (a request's last
token and its ``next_n - 1`` drafts) beside prompt chunks, and one rule for every request
keeps the output ``[reqs, next_n]`` whatever the mix, so a token bucket's graph captures it.
A request of fewer tokens repeats its first row. Extend batches keep one row per request."""

BATCH = "batch"
"""Owner name of the batch's own tensors in the planner's tables (no backend may take it)."""

BATCH_TABLES = frozenset({"req_to_token"})
"""Device tables the engine owns; ops read them in place and graphs bind their address."""

HOST_INPUTS = frozenset({"seq_lens_cpu", "extend_lens_cpu"})
"""Host tensors of the batch a host op (``graph_safe=False``) may read, e.g. FlashInfer's plan."""

SOURCES = {
    "seq_lens": False,
    "extend_lens": False,
    "req_pool_indices": False,
    "positions": True,
    "out_cache_loc": True,
}
"""Batch inputs a schema can stage with ``source=``, and whether each has a row per token."""


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's batch.

    ``seq_lens_cpu`` is the KV length of each request *including* this step's
    new tokens. ``extend_lens_cpu`` is how many tokens each request adds this
    step (extend and mixed batches; decode adds 1, target-verify ``next_n``, and
    it may then be left out). Query tokens are laid out request-major, so
    ``out_cache_loc`` and ``positions`` have one entry per token.
    ``req_pool_indices``, ``positions`` and ``out_cache_loc`` may live on the
    host (staged with the lengths in one copy) or already on the device;
    ``seq_lens`` and ``extend_lens`` are optional device copies an engine may hold.

    A draft-extend batch gives each request's accepted tokens in
    ``extend_lens_cpu`` (1..``next_n``) and one ``out_cache_loc`` / ``positions``
    entry per accepted token; the planner spreads them over ``next_n`` rows per
    request. A draft-decode batch has ``next_n = k`` (its steps) and, like a
    verify batch, the KV length after its last step and all ``k`` tokens'
    slots, request-major: step ``s`` of request ``b`` is token ``b * k + s``.

    An idle batch (no request) declares in ``idle_as`` the uniform mode whose plans and
    graph it pads, with that mode's ``next_n``: under data-parallel attention a rank without
    work runs its peers' forward (vLLM #35376, SGLang #15227: idle metadata built for decode
    while the forward ran verify). Any other batch leaves it decode.
    """

    seq_lens_cpu: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    mode: ForwardMode = ForwardMode.DECODE
    next_n: int = 1
    extend_lens_cpu: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    idle_as: ForwardMode = ForwardMode.DECODE
    inputs: object | None = None
    """The planner's staging slot (``planner.step_inputs.StepInputs``) this batch's tensors
    are views of, where the engine wrote the step there itself: a replay then sends it as
    it is. None: the planner writes the batch into the slot."""

    @property
    def plans_as(self) -> ForwardMode:
        """The mode whose program and captured graph plan this batch: an idle batch's shape."""
        mode = ForwardMode(self.mode)
        return ForwardMode(self.idle_as) if mode is ForwardMode.IDLE else mode.plans_as

    @property
    def bs(self) -> int:
        """Requests in the batch."""
        shape = self.seq_lens_cpu.shape
        return shape[0] if len(shape) == 1 else -1

    @property
    def num_tokens(self) -> int:
        """Query tokens in the batch: the sum of the extend lengths (``bs * next_n`` if uniform)."""
        if self.extend_lens_cpu is None:
            return self.bs * self.next_n
        return int(self.extend_lens_cpu.numpy().sum())

    def new_tokens(self) -> torch.Tensor:
        """Tokens each request adds this step, int32 on the host (given or implied by the mode)."""
        if self.extend_lens_cpu is not None:
            return self.extend_lens_cpu
        return torch.full((max(self.bs, 0),), self.next_n, dtype=torch.int32)

    def host_input(self, name: str) -> torch.Tensor:
        """A host tensor a host op reads (``HOST_INPUTS``)."""
        return self.seq_lens_cpu if name == "seq_lens_cpu" else self.new_tokens()

    def source(self, name: str) -> torch.Tensor:
        """The batch input a schema's ``source=`` names (derived where the engine gave none)."""
        if name == "seq_lens":
            return self.seq_lens_cpu
        if name == "extend_lens":
            return self.extend_lens if self.extend_lens is not None else self.new_tokens()
        if name == "positions" and self.positions is None:
            return derive_positions(self.seq_lens_cpu, self.new_tokens())
        return getattr(self, name)


def derive_positions(seq_lens_cpu: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """Positions of this step's tokens when the engine gives none: the last ``new`` of each request.

    Request ``b`` with KV length ``L`` adding ``n`` tokens holds positions
    ``L - n .. L - 1``, request-major.
    """
    return torch.from_numpy(implied_positions(seq_lens_cpu.numpy(), new_tokens.numpy()))


def implied_positions(lens: np.ndarray, new: np.ndarray) -> np.ndarray:
    """:func:`derive_positions` over numpy arrays: int32 positions, request-major."""
    # token i of request b (global index starts[b] + i) is at L_b - n_b + i, that is its
    # global index plus L_b - ends[b]
    ends = np.cumsum(new, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    offsets = np.repeat(lens.astype(np.int64) - ends, new)
    return (np.arange(total, dtype=np.int64) + offsets).astype(np.int32)


STEP_SEP = "@"
"""A stepped plan set names step ``s`` of backend ``b`` ``b@s`` when flattened (dumps, diffs)."""


def step_key(backend: str, step: int) -> str:
    return f"{backend}{STEP_SEP}{step}"


def base_backend(key: str) -> str:
    """``nsa`` for ``nsa@2`` (and for ``nsa``): whose schema and pads a flattened plan has."""
    return key.split(STEP_SEP, 1)[0]


def _column(tensor: torch.Tensor | None, bs: int, k: int, s: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor.view(bs, k)[:, s].contiguous()


def step_batches(batch: ForwardBatch) -> list[ForwardBatch]:
    """The ``k = batch.next_n`` decode batches of a draft-decode batch, step 0 first (of an
    idle one, ``k`` idle batches of no request).

    The batch was checked at the door (``seq_lens_cpu >= k``, ``k`` tokens per
    request); the steps' own values are range-checked where they are staged.
    """
    k, bs = batch.next_n, batch.bs
    mode = ForwardMode.IDLE if batch.mode == ForwardMode.IDLE else ForwardMode.DECODE
    positions = batch.source("positions")
    steps = []
    for s in range(k):
        lens = batch.seq_lens_cpu - (k - 1 - s)
        steps.append(
            ForwardBatch(
                seq_lens_cpu=lens,
                req_pool_indices=batch.req_pool_indices,
                req_to_token=batch.req_to_token,
                out_cache_loc=_column(batch.out_cache_loc, bs, k, s),
                positions=_column(positions, bs, k, s),
                seq_lens=None if batch.seq_lens is None else batch.seq_lens - (k - 1 - s),
                mode=mode,
                next_n=1,
            )
        )
    return steps


def batches_of(batch: ForwardBatch) -> list[ForwardBatch]:
    """What a batch plans as: its steps when stepped, else itself."""
    return step_batches(batch) if batch.plans_as.stepped else [batch]
