"""One exception family for everything the planner refuses.

Engines catch ``PlanError`` at the scheduler boundary; every subclass names
the offending field, the limit it broke and the value it saw, so a bad batch
is diagnosable from the message alone, before any kernel has run.
"""

from __future__ import annotations

import warnings
from typing import Any


class PlanError(ValueError):
    """A batch, schema, config or plan the planner will not accept."""

    def __init__(
        self, message: str, *, field: str | None = None, expected: Any = None, actual: Any = None
    ) -> None:
        self.message = message
        """The message alone, without the field and values (to re-raise it under another field)."""
        self.field = field
        self.expected = expected
        self.actual = actual
        parts = [message]
        if field is not None:
            parts.insert(0, f"[{field}]")
        if expected is not None and actual is not None:
            parts.append(f"(expected {expected}, got {actual})")
        elif expected is not None:
            parts.append(f"(expected {expected})")
        elif actual is not None:
            parts.append(f"(got {actual})")
        super().__init__(" ".join(parts))


class BatchError(PlanError):
    """A forward batch that breaks the planner's limits or types."""


class SchemaError(PlanError):
    """A plan schema that is inconsistent (unknown op, cycle, bad dimension)."""


class ProviderError(PlanError):
    """No usable provider for an op, or a forced provider that is unavailable."""


class ReplayError(PlanError):
    """Replay would read stale or moved memory, or disagrees with an eager plan."""


class GraphSafetyError(PlanError):
    """Code under graph capture that a CUDA graph would not survive: a host sync, a shape
    that depends on data, or memory outside the graph's pool (``graphs.capture_guard``).

    ``what`` the refused call, ``op`` / ``provider`` the metadata op's provider that made it
    (None outside one), ``where`` the ``path:line in function`` of the Python that did."""

    what: str = ""
    op: str | None = None
    provider: str | None = None
    where: str = ""


class PlanWriteError(PlanError):
    """A layer wrote into a plan it was only allowed to read."""


class ConfigError(PlanError):
    """A YAML/JSON config that does not validate."""


class DumpError(PlanError):
    """A plan dump that is missing, truncated or corrupt."""


_SAID: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 3) -> None:
    """Warn with ``RuntimeWarning`` the first time ``message`` is said in this process.

    A provider that fails or a library that does not import changes what runs for the rest
    of the process: saying so every batch would drown the log, saying nothing would hide it.
    """
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
