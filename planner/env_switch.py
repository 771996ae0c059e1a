"""Environment switches that turn a fast path off, read once.

Why: a lookup in ``os.environ`` costs 2-3 us of host time on the H200's host, and the
switches guard paths of a few microseconds that run every plan; so each is read at its
first use and kept in its module's state (tests set that state directly).
"""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")


def switch_on(state: dict, name: str) -> bool:
    """Whether environment switch ``name`` (on unless set to 0 / false / no / off) is on:
    read once into ``state["env"]``, which a caller or a test may also set."""
    said = state["env"]
    if said is None:
        said = state["env"] = os.environ.get(name, "1").lower() not in _OFF
    return bool(said)
