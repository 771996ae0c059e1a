"""Things the planner says once per process: fallbacks and degraded paths, never per step.

A provider that fails or a library that does not import changes what runs for
the rest of the process; saying so on every batch would drown the log and
cost host time, saying nothing would hide it. One warning per distinct message.
"""

from __future__ import annotations

import warnings

_SAID: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 3) -> None:
    """Warn with ``RuntimeWarning`` the first time ``message`` is said in this process."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
