"""A separate package adds a backend through the entry-point group, without touching this repo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO

EXAMPLE = REPO / "tests" / "fixtures" / "example_backend"

PLAN_IT = """
import torch
from planner import ForwardBatch, Limits, Planner
planner = Planner(["example-window"], Limits(max_batch=4, max_context=64), options={"example-window": {"window": 8}})
table = torch.arange(5 * 64, dtype=torch.int32).view(5, 64)
batch = ForwardBatch(seq_lens_cpu=torch.tensor([3, 20, 9], dtype=torch.int32),
                     req_pool_indices=torch.tensor([1, 2, 3]), req_to_token=table,
                     out_cache_loc=torch.tensor([1, 2, 3], dtype=torch.int32))
plan = planner.plan(batch)["example-window"]
print(plan.window_lens.tolist(), plan.cu_window.tolist(), plan.window)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / "example_backend"
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
    assert {"backend": "example-window", "field": "window_lens"}.items() <= next(
        r for r in rows if r["backend"] == "example-window" and r["field"] == "window_lens"
    ).items()


def test_third_party_backend_is_planned(installed):
    out = subprocess.run(
        [sys.executable, "-c", PLAN_IT], env=installed, check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == "[3, 8, 8] [0, 3, 11, 19] 8"


def test_not_listed_without_the_package():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert all(r["backend"] != "example-window" for r in _listed_backends(env))
