"""Each step's input ids on the device: prompt tokens from the host, and every decode row's
token from where its request's last step sampled it, on the device.

Why: a loop that runs one step ahead (``loop.overlap``) builds and launches step N+1 before
step N's tokens reach the host, so a decode row cannot name its token on the host. Each
step's sampling writes its tokens into :attr:`TokenIds.last`, one entry per request row of
the pool (:meth:`TokenIds.sampled`); the next step's ids name such a token as
``last_of(pool row)`` and are resolved there by one gather, behind the sampling on the same
stream. The synchronous loop takes the same path (it knows the token by then, but a second
way to feed ids is a second path to keep right); speculative verify feeds its drafts and
tokens from the host, as it reads every step before the next.
"""

from __future__ import annotations

import torch


def last_of(pool_row: int) -> int:
    """The id of "the token request row ``pool_row`` sampled last": negative, so a prompt
    token (``>= 0``) is never taken for one."""
    return -1 - pool_row


class TokenIds:
    """The last sampled token of every request row, on the device, and the step's ids."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)
        """Row ``r``: the token the request in pool row ``r`` sampled last."""

    def ids(self, host: list[int]) -> torch.Tensor:
        """``host`` (tokens, and ``last_of(row)`` for a row's last sampled token) on the
        device, resolved: one copy, and one gather where any id is a ``last_of``."""
        sent = self._send(host)
        if not host or min(host) >= 0:
            return sent
        rows = (-1 - sent).clamp_(min=0)
        return torch.where(sent >= 0, sent, self.last.index_select(0, rows))

    def _send(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device, copied out of pinned memory on CUDA: a copy out of
        pageable memory may wait for the stream, i.e. for the step still running."""
        pinned = self.device.type == "cuda"
        host = torch.tensor(values, dtype=torch.int64, pin_memory=pinned)
        return host.to(self.device, non_blocking=pinned)

    def sampled(self, pool_rows: list[int], tokens: torch.Tensor) -> None:
        """Keep ``tokens[i]`` as the last sampled token of pool row ``pool_rows[i]`` (on the
        device, behind the step that sampled them)."""
        self.last.index_copy_(0, self._send(pool_rows), tokens.to(torch.int64))
