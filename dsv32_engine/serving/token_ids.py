"""Each step's input ids on the device: prompt tokens from the host, and every decode row's
token from where its request's last step sampled it, on the device.

Why: a loop that runs one step ahead (``loop.overlap``) builds and launches step N+1 before
step N's tokens reach the host, so a decode row cannot name its token on the host. The host
sends each step's ids as they are known to it, a decode row's as ``last_of(pool row)``
(:meth:`TokenIds.send`, one copy). Everything else runs inside the step's forward, captured
with the model in its graph: the ids are resolved there (:meth:`TokenIds.resolve`, a gather
of :attr:`TokenIds.last`), and the step's sampled tokens written back into
:attr:`TokenIds.last` by pool row (:meth:`TokenIds.sampled`). A step is then one launch and
one copy each way, not a dozen small launches beside its graph, each a gap on the device.
The synchronous loop takes the same path (it knows the token by then, but a second way to
feed ids is a second path to keep right).

Speculative verify under the MTP draft feeds its drafts the same way: the draft decode's
tokens stay on the device, in :attr:`TokenIds.table` by pool row (:meth:`TokenIds.drafted`),
and the verify sends ``draft_of`` each (:meth:`TokenIds.draft_of`), so the host launches the
draft forwards and goes on to build the next step without waiting for them; it reads the
drafts' values with the verify's tokens, for acceptance. An n-gram draft's tokens are the
host's own, sent as they are.
"""

from __future__ import annotations

import torch


def last_of(pool_row: int) -> int:
    """The id of "the token request row ``pool_row`` sampled last": negative, so a prompt
    token (``>= 0``) is never taken for one."""
    return -1 - pool_row


class TokenIds:
    """The last sampled token (and drafts) of every request row, on the device, and the
    step's ids."""

    def __init__(self, rows: int, device: torch.device, drafts: int = 0) -> None:
        self.device = device
        self.rows = rows
        self.table = torch.zeros(1 + drafts, rows, dtype=torch.int64, device=device)
        """``[1 + drafts, rows]``: row 0 is :attr:`last`; row ``1 + i``, column ``r``: the
        ``i``-th draft the request in pool row ``r`` proposed last (:meth:`drafted`). One
        tensor, so :meth:`resolve` gathers any of them with one index."""
        self.last = self.table[0]
        """``last[r]``: the token the request in pool row ``r`` sampled last. ``last[0]`` is
        the null request's: padding rows write it and nothing real reads it."""

    def draft_of(self, pool_row: int, i: int) -> int:
        """The id of "draft ``i`` of pool row ``pool_row``" (:meth:`drafted` wrote it): below
        every ``last_of`` id, so the two never meet."""
        if not 0 <= i < self.table.shape[0] - 1:
            raise ValueError(
                f"draft {i} of pool row {pool_row}: this table holds "
                f"{self.table.shape[0] - 1} drafts a row (speculative.draft_tokens - 1)"
            )
        return -1 - (1 + i) * self.rows - pool_row

    def send(self, host: list[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` (tokens, and ``last_of(row)`` for a row's last sampled token) on the
        device as they are, in one copy out of pinned memory on CUDA (a copy out of pageable
        memory may wait for the stream, i.e. for the step still running); into the first
        ``len(host)`` entries of ``into`` where given (a static buffer a graph reads)."""
        pinned = self.device.type == "cuda"
        values = torch.tensor(host, dtype=torch.int64, pin_memory=pinned)
        if into is None:
            return values.to(self.device, non_blocking=pinned)
        return into[: len(host)].copy_(values, non_blocking=pinned)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` as :meth:`send` put them, with every ``last_of(row)`` replaced by that row's
        last sampled token and every ``draft_of(row, i)`` by its draft: device ops only, so a
        captured forward runs it in its graph."""
        slots = (-1 - ids).clamp_(min=0)
        return torch.where(ids >= 0, ids, self.table.view(-1).index_select(0, slots))

    def sampled(self, pool_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep ``tokens[i]`` as the last sampled token of pool row ``pool_rows[i]`` (device
        tensors; in the sampling step's graph, behind its sampling)."""
        self.last.index_copy_(0, pool_rows.to(torch.int64), tokens.to(torch.int64))

    def drafted(self, pool_rows: torch.Tensor, drafts: torch.Tensor) -> None:
        """Keep ``drafts[j]`` (``[requests, k]``, ``k`` at most the table's) as the drafts of
        pool row ``pool_rows[j]``, on the device: what the next verify's ``draft_of`` ids
        read, in stream order behind the forwards that proposed them."""
        k = drafts.shape[1]
        self.table[1 : 1 + k].index_copy_(1, pool_rows.to(torch.int64), drafts.t().to(torch.int64))
