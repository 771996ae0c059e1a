"""Run-time provider fallback: a provider that fails is retired for the op, once, with a notice.

A JIT compile error or a broken optional install shows up on the first call,
not at import. Serving must go on with the next best provider for that op
(same graph safety, so where the step runs does not change), say so once,
and never try the failed one again. The torch reference is never replaced
(its failure is a bug to surface), nor a provider the config forced (the
user asked for exactly that one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planner.errors import PlanError, ProviderError
from planner.notices import warn_once
from planner.ops import MetadataOp, Provider


class ProviderChain:
    """The provider an op runs with in one planner, and the ones it may fall back to."""

    def __init__(self, op: MetadataOp, device: torch.device, forced: str | None) -> None:
        self.op = op
        self.device = device
        self.forced = forced
        self.current: Provider = op.select(device, forced)
        self.retired: set[str] = set()

    def call(
        self, key: str, out: torch.Tensor, args: Sequence[Any], params: Mapping[str, Any]
    ) -> Any:
        """Run the current provider and return what it returns (a host op's handle, or None).

        On failure the provider is retired and the next best runs on the same
        inputs; providers write every element of ``out``, so a retry over a
        half-written output is exact.
        """
        while True:
            provider = self.current
            try:
                return provider.fn(out, *args, **params)
            except PlanError:
                raise
            except Exception as exc:
                if provider.name == "torch":
                    raise
                if self.forced is not None:
                    raise ProviderError(
                        f"forced provider failed: {exc!r}", field=key, actual=provider.name
                    ) from exc
                self._retire(provider, exc)

    def _retire(self, failed: Provider, exc: Exception) -> None:
        self.retired.add(failed.name)
        usable = [
            p
            for p in self.op.providers.values()
            if p.name not in self.retired
            and not p.host
            and p.graph_safe == failed.graph_safe
            and p.is_available(self.device)
        ]
        if not usable:
            raise ProviderError(
                f"every provider failed, the last with {exc!r}", field=self.op.name
            ) from exc
        self.current = min(usable, key=lambda p: (p.rank, p.name))
        warn_once(
            f"{self.op.name}: provider {failed.name!r} failed ({type(exc).__name__}: {exc}); "
            f"using {self.current.name!r} from now on"
        )
