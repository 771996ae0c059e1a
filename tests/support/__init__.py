"""What the test folders share: paths, batches, planners, a tiny paged model, catalogue cases."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (configs/, benchmarks/, docs/ and the packages)."""
TINY_YAML = REPO / "configs" / "dsv32-tiny.yaml"
"""The tiny DeepSeek-V3.2 run config the engine tests serve."""
