"""A separate package adds a backend through the entry-point group, without touching this repo:
the example plugin (``examples/plugin``), installed into a directory of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from planner.registry import ENTRY_POINT_GROUP
from tests.support import REPO

EXAMPLE = REPO / "examples" / "plugin"

PLAN_IT = """
import torch
from planner import ForwardBatch, Limits, Planner
planner = Planner(["example-mla"], Limits(max_batch=4, max_context=512, num_sms=8),
                  options={"example-mla": {"block_n": 128}})
table = torch.arange(5 * 512, dtype=torch.int32).view(5, 512)
batch = ForwardBatch(seq_lens_cpu=torch.tensor([300, 20, 129], dtype=torch.int32),
                     req_pool_indices=torch.tensor([1, 2, 3]), req_to_token=table,
                     out_cache_loc=torch.tensor([1, 2, 3], dtype=torch.int32))
plan = planner.plan(batch)["example-mla"]
print(plan.num_splits.tolist(), plan.sm_parts, plan.block_n)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / "plugin"
    shutil.copytree(EXAMPLE, source)  # building in place would leave build/ in the repository
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        cwd=target,
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}


def _listed_backends(env: dict[str, str]) -> list[dict]:
    """The rows of ``python -m planner backends --json`` run with ``env``."""
    out = subprocess.run(
        [sys.executable, "-m", "planner", "backends", "--json"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def test_third_party_backend_is_listed(installed):
    rows = _listed_backends(installed)
    fields = {r["field"] for r in rows if r["backend"] == "example-mla"}
    assert {"tile_scheduler_metadata", "num_splits", "block_table"} <= fields


def test_third_party_backend_is_planned(installed):
    out = subprocess.run(
        [sys.executable, "-c", PLAN_IT], env=installed, check=True, capture_output=True, text=True
    )
    # 3 + 1 + 2 blocks of 128 over 8 // 2 = 4 SM parts, 2 blocks each (sm_parts: 1 KV head,
    # 128 query heads in two 64-row tiles)
    assert out.stdout.strip() == "[0, 2, 3, 4] 4 128"


def test_not_listed_without_the_package():
    if any(ep.name == "example-mla" for ep in entry_points(group=ENTRY_POINT_GROUP)):
        pytest.skip("the example plugin is installed in this environment (CI installs it)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert all(r["backend"] != "example-mla" for r in _listed_backends(env))
