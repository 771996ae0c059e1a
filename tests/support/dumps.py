"""Plan dumps for the dump tests: the planner they plan with, bit-for-bit checks, a probe dump."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from planner import PlanSet
from planner.debug import tensor_digest
from planner.dumps import dump_plans
from tests.support.planners import PlannerSetup

DUMPS = PlannerSetup(("paged",), max_batch=12, max_context=200, page_size=16, pool=40, seed=5)
"""The paged planner and 40-request table every dump test plans with."""


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_bits(plans: PlanSet, loaded) -> None:
    """Every tensor field bit for bit (NaN payloads and -0.0 included), every scalar, every pointer."""
    assert loaded.backends == list(plans)
    for backend, plan in plans.items():
        manifest = loaded.manifests[backend]
        for name, tensor in plan.tensors().items():
            got = loaded.tensors[backend][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert bits(got) == bits(tensor), name
            record = manifest.fields[name]
            assert record.checksum == tensor_digest(tensor)
            assert record.data_ptr == tensor.data_ptr()
            assert record.device == str(tensor.device)
        assert loaded.scalars(backend) == plan.scalars()


def probe_dump(directory: Path) -> tuple[Path, PlanSet]:
    """An eager plan of a 5-request batch, dumped as step 42 labelled 'probe'."""
    planner = DUMPS.planner()
    batch = DUMPS.batch(random.Random(4), bs=5)
    plans = planner.plan(batch)
    return dump_plans(plans, directory / "d", step=42, batch=batch, label="probe"), plans
