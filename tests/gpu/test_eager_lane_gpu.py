"""The eager lane on a real GPU: host inputs, a CUDA token table, pinned staging, recycled
memory and the fused Triton launch; its plans are bit-equal to the general path's, batch
after batch of a growing decode, and it stands aside for device-resident inputs."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from planner.compare import diff_plans
from tests.support.growing_decode import TABLE, growing, small_planner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _on_cuda_table(batch, table):
    """The batch with its index inputs left on the host and the token table on the GPU:
    what an engine hands the planner."""
    return dataclasses.replace(batch, req_to_token=table)


def _pair():
    fast, plain = small_planner("cuda"), small_planner("cuda")
    plain._eager_lanes._next_n.clear()
    return fast, plain


@pytest.mark.parametrize("bs", [1, 3, 6])
def test_a_growing_decode_takes_the_lane_and_plans_as_the_general_path(bs):
    fast, plain = _pair()
    table = TABLE.cuda()
    held = []
    for step, batch in enumerate(growing(24, bs=bs, seed=bs)):
        batch = _on_cuda_table(batch, table)
        got, want = fast.plan(batch), plain.plan(batch)
        assert fast._eager_lanes.taken == step + 1
        assert diff_plans(got, want) == []
        held = [got]  # the step before is dropped: its memory comes back
    torch.cuda.synchronize()
    assert held


def test_device_resident_inputs_take_the_general_path():
    fast, plain = _pair()
    batch = growing(1, bs=3, seed=1, device="cuda")[0]
    assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    assert fast._eager_lanes.taken == 0


def test_random_lengths_plan_alike():
    fast, plain = _pair()
    table = TABLE.cuda()
    rng = random.Random(3)
    for _ in range(20):
        batch = growing(1, bs=rng.randint(1, 6), seed=rng.randint(0, 10**6))[0]
        batch = _on_cuda_table(batch, table)
        assert diff_plans(fast.plan(batch), plain.plan(batch)) == []
    assert fast._eager_lanes.taken == 20
