"""Plan dumps for the dump tests: a paged planner over a 40-request table, bit-for-bit checks."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from planner import Limits, Planner, PlanSet
from planner.compare import tensor_digest
from planner.dumps import dump_plans
from tests.support.batches import make_pool, random_batch

PAGE, MAX_CTX, MAX_BATCH = 16, 200, 12
TABLE = make_pool(40, MAX_CTX, PAGE, seed=5)


def dump_planner(next_n: int = 1, **kwargs) -> Planner:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CTX, page_size=PAGE, next_n=next_n)
    return Planner(["paged"], limits, **kwargs)


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
    planner = dump_planner()
    batch = random_batch(random.Random(4), TABLE, max_batch=MAX_BATCH, max_context=MAX_CTX, bs=5)
    plans = planner.plan(batch)
    return dump_plans(plans, directory / "d", step=42, batch=batch, label="probe"), plans
