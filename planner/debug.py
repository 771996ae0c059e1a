"""Debug mode: prove that replayed plans equal fresh ones, and that layers only read them.

Off by default (``PLANNER_DEBUG=1`` or ``debug=True`` turns it on), because both
checks copy plans to the host. ``check_replay`` compares a replayed plan set
with an eager plan of the same padded batch bit for bit, and the padding rows
with the schemas' pad values; ``guard`` digests plans around a forward. A
mismatch is handed to the planner's declared ``on_mismatch`` hook (dumps
use it) before the error is raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from planner.compare import diff_plans, padding_violations, plan_digests
from planner.errors import ConfigError, PlanWriteError, ReplayError
from planner.schema import Plan

if TYPE_CHECKING:
    from planner.batch import ForwardBatch
    from planner.planset import PlanSet

MismatchHook = Callable[["ForwardBatch", "PlanSet", "PlanSet"], None]
"""``on_mismatch(batch, replayed, eager)``: called before a mismatch is raised."""

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}


def debug_from_env() -> bool:
    """``PLANNER_DEBUG``: a misspelt value must not silently leave the checks off."""
    value = os.environ.get("PLANNER_DEBUG", "").strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ConfigError(
        "not a boolean",
        field="PLANNER_DEBUG",
        expected="1/true/yes/on or 0/false/no/off",
        actual=value,
    )


def check_replay(
    batch: ForwardBatch,
    replayed: PlanSet,
    eager: PlanSet,
    pads: Mapping[tuple[str, str], object],
    real: dict[str, int],
    on_mismatch: MismatchHook | None,
) -> None:
    """Raise ``ReplayError`` unless ``replayed`` equals ``eager`` and its padding holds the pads."""
    mismatches = diff_plans(replayed, eager)
    bad_pad = padding_violations(replayed, pads, real)
    if not mismatches and not bad_pad:
        return
    if on_mismatch is not None:
        on_mismatch(batch, replayed, eager)
    detail = "; ".join(
        [m.describe() for m in mismatches]
        + [f"{k}: padding rows hold wrong values" for k in bad_pad]
    )
    first = mismatches[0].backend + "." + mismatches[0].field if mismatches else bad_pad[0]
    raise ReplayError(
        f"replayed plan differs from eager (stale buffer, or a layer wrote into it): {detail}",
        field=first,
    )


@contextmanager
def guard(plans: Mapping[str, Plan], enabled: bool) -> Iterator[None]:
    """Digest plans before and after the forward; a layer that wrote raises ``PlanWriteError``."""
    if not enabled:
        yield
        return
    before = plan_digests(plans)
    yield
    after = plan_digests(plans)
    changed = sorted(k for k in before if before[k] != after[k])
    if changed:
        raise PlanWriteError(
            "a layer wrote into a plan it may only read", field=changed[0], actual=changed
        )
