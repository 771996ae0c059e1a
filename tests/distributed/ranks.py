"""Running a scenario in several gloo processes, and reading back what each rank saw.

``run_ranks`` spawns ``world`` ranks (``distributed.group.spawn``: fresh processes, a
free port, the torchrun variables set); each joins a gloo group with a short timeout,
runs one scenario of ``tests.distributed.scenarios`` and writes its JSON result; a rank
that raises fails the test with its traceback.
"""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path
from typing import Any

import torch

from dsv32_engine.distributed.group import env_rank, init, shutdown, spawn
from tests.distributed import scenarios

TIMEOUT_S = 20.0
"""Collective timeout of the test groups: a hang fails in seconds, not minutes."""


def _rank(out: str, scenario: str, kwargs: dict[str, Any]) -> None:
    faulthandler.enable()  # a C++ abort in a rank still shows where it happened
    torch.set_num_threads(1)
    rank, world, _ = env_rank()
    timeout = kwargs.pop("timeout_s", TIMEOUT_S)
    ctx = init(rank, world, torch.device("cpu"), backend="gloo", timeout_s=timeout)
    try:
        result = getattr(scenarios, scenario)(ctx, **kwargs)
    finally:
        shutdown()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(tmp: Path, scenario: str, world: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """Every rank's result of ``scenarios.<scenario>(ctx, **kwargs)``, by rank."""
    spawn(_rank, world, (str(tmp), scenario, kwargs))
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
