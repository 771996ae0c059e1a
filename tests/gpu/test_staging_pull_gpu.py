"""Staging in the graph with real CUDA graphs: the graph's kernel reads the pinned ring
through the device's mapping of it, and every step equals eager, also while the host runs
many launches ahead of the GPU (the ring's slots are then refilled only once pulled)."""

from __future__ import annotations

import random

import pytest
import torch

from graphs.staging_pull import SLOTS, PulledTransport
from planner import ForwardMode
from tests.gpu.test_graphs_gpu import DECODE, VERIFY, _check_step, _setup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PULL = {"transport": PulledTransport}


def _rings(runner):
    stagers = {id(c.stager): c.stager for c in runner.planner._captured.values()}
    return [s.transport.ring for s in stagers.values()]


def test_cuda_graphs_that_pull_their_inputs_equal_eager():
    runner, model, twin, ref, sched = _setup(
        16, 256, seed=4, sizes=[1, 2, 4, 8, 16], planner_kw=PULL
    )
    rng = random.Random(4)
    for _ in range(150):
        batch, inputs = sched.batch(rng.randint(1, 16), rng.choice([DECODE, VERIFY]), "cuda")
        _check_step(runner, twin, ref, batch, inputs)
    rings = _rings(runner)
    assert len(rings) == 2  # decode's and verify's
    assert sum(r.seq for r in rings) == runner.stats.graph_steps == 150


def test_the_host_running_ahead_of_the_gpu_waits_for_the_pulls():
    """Each step queues a millisecond of GPU work first, so the host is soon ``SLOTS``
    launches ahead; no step is checked before the end, and every one equals eager."""
    runner, _, twin, ref, sched = _setup(8, 128, seed=6, sizes=[2, 4, 8], planner_kw=PULL)
    rng = random.Random(6)
    # made first: a batch's own host-to-device copies wait for the GPU, which would keep
    # the host from getting ahead
    steps = [sched.batch(rng.randint(1, 8), DECODE, "cuda") for _ in range(4 * SLOTS)]
    runner.capture()
    torch.cuda.synchronize()
    got = []
    for batch, inputs in steps:
        torch.cuda._sleep(2_000_000)
        got.append(runner.step(batch, inputs)["meta"].clone())
    (ring,) = [r for r in _rings(runner) if r.mode == ForwardMode.DECODE.value]
    assert ring.waits > 0, "the host never got a ring ahead: the test proves nothing"
    torch.cuda.synchronize()
    for step, (out, (batch, inputs)) in enumerate(zip(got, steps)):
        assert torch.equal(out, twin(inputs, ref.plan(batch))["meta"]), f"step {step}"
