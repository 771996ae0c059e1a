"""``python -m planner ...`` as a user runs it: a fresh interpreter in the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from tests.support import REPO


def planner_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the command line with ``args``; the work tree first on the import path."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "planner", *args],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
