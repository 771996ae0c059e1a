"""What the graph runner did: the numbers that show whether graphs pay off.

A graph that is never replayed, a size whose capture failed, or a stream of
batches that all fall back to eager cost memory and capture time for nothing;
none of that is visible from outputs. These counters make it visible, and
split host time into planner refresh and graph launch so a slow step can be
attributed.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.batch import RAGGED_MODES

HOST_PHASES = ("refresh", "inputs", "replay", "verify", "eager")
"""Host-time buckets: planner refresh, input copy, graph replay call, debug verify, eager steps."""


@dataclass
class GraphStats:
    """Capture results, memory, and per-step counters of one runner."""

    kind: str = "emulated"
    captured: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, dict[int, str]] = field(default_factory=dict)
    pool_allocated_bytes: int | None = None
    pool_reserved_bytes: int | None = None
    planner_static_bytes: int = 0
    input_bytes: int = 0
    capture_seconds: float = 0.0
    steps: int = 0
    real_rows: int = 0
    padded_rows: int = 0
    replays: Counter = field(default_factory=Counter)
    """Replays by (mode, size): a uniform graph's request bucket, a ragged one's token bucket."""
    ragged_refresh_seconds: float = 0.0
    """Planner host time of the ragged replays (extend, mixed), inside ``host_seconds``'s
    refresh: what a prompt chunk's replay costs on the host."""
    capture_costs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per captured graph (``decode/8``, ``extend/t512``): capture seconds, split into the
    planner's capture plans (``plan_seconds``; a first capture of a shape includes its
    kernels' JIT compiles), the eager warm-up runs until the device finished them
    (``warmup_seconds``) and the recording, instantiation included (``record_seconds``); on
    CUDA, the bytes its capture added to the pool."""
    eager: Counter = field(default_factory=Counter)
    """Eager fallbacks by reason: batches a graph should have served."""
    ragged: Counter = field(default_factory=Counter)
    """Extend and mixed batches by mode: eager by design, not fallbacks."""
    host_seconds: Counter = field(default_factory=Counter)

    @property
    def graph_steps(self) -> int:
        return sum(self.replays.values())

    @property
    def ragged_replays(self) -> int:
        """Replays of ragged graphs (prompt chunks, mixed steps)."""
        return sum(n for (mode, _), n in self.replays.items() if mode in RAGGED_LABELS)

    @property
    def hit_rate(self) -> float:
        """Fraction of steps that replayed a graph."""
        return self.graph_steps / self.steps if self.steps else 0.0

    @property
    def static_bytes(self) -> int:
        return self.planner_static_bytes + self.input_bytes

    def reset_counters(self) -> None:
        """Zero the per-step counters (after warm-up, before a measurement); keep capture facts."""
        self.steps = self.real_rows = self.padded_rows = 0
        self.replays.clear()
        self.eager.clear()
        self.host_seconds.clear()
        self.ragged_refresh_seconds = 0.0

    def summary(self) -> dict[str, Any]:
        """A JSON-ready dict of everything above."""
        per_step = {
            k: self.host_seconds[k] / self.steps if self.steps else 0.0 for k in HOST_PHASES
        }
        return {
            "kind": self.kind,
            "captured": {mode: list(sizes) for mode, sizes in self.captured.items()},
            "dropped": {
                mode: {str(bs): why for bs, why in d.items()} for mode, d in self.dropped.items()
            },
            "graphs": sum(len(s) for s in self.captured.values()),
            "pool_allocated_bytes": self.pool_allocated_bytes,
            "pool_reserved_bytes": self.pool_reserved_bytes,
            "planner_static_bytes": self.planner_static_bytes,
            "input_bytes": self.input_bytes,
            "static_bytes": self.static_bytes,
            "capture_seconds": self.capture_seconds,
            "steps": self.steps,
            "graph_steps": self.graph_steps,
            "hit_rate": self.hit_rate,
            "replays": {_label(mode, size): n for (mode, size), n in sorted(self.replays.items())},
            "capture_costs": {label: dict(cost) for label, cost in self.capture_costs.items()},
            "ragged_replays": self.ragged_replays,
            "planner_us_per_ragged_replay": 1e6 * self.ragged_refresh_seconds / self.ragged_replays
            if self.ragged_replays
            else 0.0,
            "eager_fallbacks": dict(sorted(self.eager.items())),
            "ragged_steps": dict(sorted(self.ragged.items())),
            "padding_fraction": self.padded_rows / (self.real_rows + self.padded_rows)
            if self.real_rows + self.padded_rows
            else 0.0,
            "host_seconds": {k: self.host_seconds[k] for k in HOST_PHASES},
            "host_seconds_per_step": per_step,
        }

    def table(self) -> Table:
        """A rich table of the summary, for the decode loop and benchmarks."""
        s = self.summary()
        table = Table(title=f"CUDA graphs ({s['kind']})", show_header=True)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for mode, sizes in s["captured"].items():
            table.add_row(f"captured {mode}", _sizes(sizes))
        for mode, dropped in s["dropped"].items():
            for bs, why in dropped.items():
                table.add_row(f"dropped {mode}/{bs}", why[:60])
        table.add_row("pool allocated", _bytes(s["pool_allocated_bytes"]))
        table.add_row("pool reserved", _bytes(s["pool_reserved_bytes"]))
        table.add_row("static buffers", _bytes(s["static_bytes"]))
        table.add_row("capture time", f"{s['capture_seconds']:.3f} s")
        for label, cost in s["capture_costs"].items():
            if label.split("/")[0] in RAGGED_LABELS:  # the uniform ones: in the JSON summary
                pool = cost.get("pool_allocated_bytes")
                table.add_row(
                    f"capture {label}",
                    f"{cost['seconds']:.3f} s" + (f", {_bytes(pool)}" if pool is not None else ""),
                )
        table.add_row("steps / graph hit rate", f"{s['steps']} / {s['hit_rate']:.1%}")
        table.add_row("padding rows", f"{s['padding_fraction']:.1%}")
        for reason, n in s["eager_fallbacks"].items():
            table.add_row(f"eager: {reason}", str(n))
        for key, n in s["replays"].items():
            table.add_row(f"replays {key}", str(n))
        for phase, sec in s["host_seconds_per_step"].items():
            if sec:
                table.add_row(f"host {phase} / step", f"{sec * 1e6:.1f} us")
        return table

    def render(self, width: int = 100) -> str:
        """The table as plain text."""
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(self.table())
        return console.export_text()


RAGGED_LABELS = frozenset(mode.value for mode in RAGGED_MODES)
"""Modes whose graphs are keyed by token bucket (``extend/t512``)."""


def _label(mode: str, size: int) -> str:
    return f"{mode}/t{size}" if mode in RAGGED_LABELS else f"{mode}/{size}"


def _sizes(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if sizes else "-"


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
