"""What benchmarks/verify_flashinfer.py reports per configuration, and its tolerances.

The counters of ``Report`` are what the run is judged by (``ok``); its JSON is the
script's ``configs`` entries and ``summarize`` its printed table.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

ATOL = RTOL = 1e-2  # bf16 inputs and output against an fp32 reference


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0


def within_tolerance(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=RTOL))


@dataclass
class Report:
    name: str
    config: dict[str, Any]
    steps: int = 0
    eager_max_err: float = 0.0
    replay_max_err: float = 0.0
    replay_vs_eager: float = 0.0
    warmup_max_err: float = 0.0
    bad_outputs: int = 0
    verify_failures: int = 0
    pointer_failures: int = 0
    sync_warnings: int = 0
    replay_host_us: list[float] = field(default_factory=list)
    eager_host_us: list[float] = field(default_factory=list)
    capture_s: float = 0.0
    providers: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        bad = self.bad_outputs + self.verify_failures + self.pointer_failures + self.sync_warnings
        return self.error is None and self.steps > 0 and bad == 0 and self.warmup_max_err <= 0.5

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(message)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("replay_host_us", "eager_host_us"):
            values = data.pop(key)
            data[f"{key}_median"] = statistics.median(values) if values else None
        data["ok"] = self.ok
        return data


def summarize(reports: list[Report]) -> str:
    head = (
        f"{'config':<16} {'steps':>5} {'eager err':>9} {'replay err':>10} {'r-e':>8} {'warmup':>8} "
        f"{'bad':>4} {'verify':>6} {'ptrs':>5} {'syncs':>5} {'replay us':>9} {'eager us':>9} {'ok':>3}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        j = r.to_json()
        lines.append(
            f"{r.name:<16} {r.steps:>5} {r.eager_max_err:>9.2e} {r.replay_max_err:>10.2e} "
            f"{r.replay_vs_eager:>8.1e} {r.warmup_max_err:>8.1e} {r.bad_outputs:>4} "
            f"{r.verify_failures:>6} {r.pointer_failures:>5} {r.sync_warnings:>5} "
            f"{j['replay_host_us_median'] or 0:>9.0f} {j['eager_host_us_median'] or 0:>9.0f} "
            f"{'yes' if r.ok else 'NO':>3}"
        )
    return "\n".join(lines)
