"""A step's outputs on their way to the host, with the planner's error word.

Why: a loop that blocks on each step's sampled tokens before it builds the next leaves the
GPU idle for the whole of the host's step (scheduling, planning, launching). An engine that
runs one step ahead starts the read of step N's outputs right behind step N on its stream,
launches step N+1, and only then waits for step N's copy, which by then has long run.

:meth:`~planner.planner.Planner.read_later` puts a step's outputs and the error word the
device checks write (``planner.device_checks``) into one host buffer (pinned on CUDA, from
torch's caching host allocator) with one asynchronous copy, and records an event behind it.
:meth:`PendingRead.get` waits for that event alone, never for the device's later work, and
raises the refusal the word holds before it hands out any value: the word copied is the one
as the step left it, so a refused batch raises with its own outputs, and a later step's
refusal with that later step's. :meth:`~planner.planner.Planner.read` is ``read_later``
followed by ``get``: the synchronous loop takes the same path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from planner.errors import ReplayError


class PendingRead:
    """One step's outputs copied (or being copied) to the host; :meth:`get` once."""

    def __init__(
        self,
        values: torch.Tensor,
        word: torch.Tensor,
        on_word: Callable[[Sequence[int]], None],
        step: int,
    ) -> None:
        self.shape = tuple(values.shape)
        self.step = step
        """Which read of the planner this is (0, 1, ...), for errors."""
        self._n = values.numel()
        self._on_word = on_word
        flat = torch.cat([values.reshape(-1).to(torch.int64), word.to(torch.int64)])
        self._event: torch.cuda.Event | None = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat
        self._taken = False

    def ready(self) -> bool:
        """Whether :meth:`get` would return without waiting."""
        return self._event is None or self._event.query()

    def get(self) -> list | int:
        """The values as ``values.tolist()`` gives them, once their copy has run; raises
        the refusal of a batch the device check refused (none of its values returned)."""
        if self._taken:
            raise ReplayError(
                f"read {self.step} was already taken: a step's outputs are read once",
                field="read",
                expected="one get() per read_later()",
                actual=f"a second get() of read {self.step}",
            )
        self._taken = True
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        n = self._n
        self._on_word(flat[n:])
        if not self.shape:
            return flat[0]
        if len(self.shape) == 1:
            return flat[:n]
        return torch.tensor(flat[:n]).view(self.shape).tolist()
