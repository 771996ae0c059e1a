"""The staging copy through cudaMemcpyAsync (``planner.cuda_copy``): what ``copy_`` would
have sent, in stream order, taken by replays and eager plans alike."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from planner import Limits, Planner  # noqa: E402
from planner.cuda_copy import state, to_device  # noqa: E402
from tests.support.batches import make_pool, random_batch  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_direct_copy_sends_what_copy_sends_in_stream_order(dtype):
    before = state.direct
    host = torch.empty(4099, dtype=dtype, pin_memory=True)
    dev = torch.full((4099,), -1, dtype=dtype, device=DEV)
    for step in range(20):
        host.copy_(torch.randint(-(2**30), 2**30, (4099,), dtype=dtype))
        expected = host.clone()
        dev.mul_(0)  # queued before the copy: the copy must land after it
        to_device(dev, host, DEV.index or 0)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(dev.cpu(), expected), step
    assert state.direct == before + 20


def test_a_mismatched_copy_falls_back_to_copy_and_its_error():
    host = torch.zeros(8, dtype=torch.int32, pin_memory=True)
    with pytest.raises(RuntimeError):
        to_device(torch.zeros(9, dtype=torch.int32, device=DEV), host, DEV.index or 0)


def test_replays_and_eager_plans_copy_directly_and_stay_exact():
    table = make_pool(9, 512, 64, seed=2).to(DEV)
    limits = Limits(
        max_batch=4, max_context=512, num_sms=8, kv_slots=int(table.max()) + 1, device="cuda"
    )
    planner = Planner(
        ["paged", "nsa"], limits, options={"nsa": {"topk": 64}}, debug=True, ops_in_graph=False
    )
    planner.capture(4, req_to_token=table)
    rng = random.Random(3)
    before = state.direct
    for _ in range(10):
        batch = random_batch(rng, table, max_batch=4, max_context=512)
        planner.plan(batch)
        plans = planner.replay(batch, 4)
        planner.verify(batch, plans)  # debug mode: the replay equals a fresh eager plan
    assert state.direct >= before + 20
