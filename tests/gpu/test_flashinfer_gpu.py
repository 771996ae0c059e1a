"""Real FlashInfer (flashinfer-python 0.5.3) against the backends.flashinfer references, on CUDA.

Skipped cleanly without CUDA or without flashinfer. The configurations and
checks are those of ``benchmarks/verify/flashinfer.py`` (one source of truth:
eager, capture and replay within bf16 tolerance of the fp32 reference,
replayed metadata bit-equal to eager, pointers and wrapper bindings fixed, no
synchronising call on the replay path), over smaller limits and fewer
batches. Expect 10-60 s of JIT compilation per FlashInfer module on a cold
cache (decode, tensor-core decode, MLA).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

from benchmarks.verify.flashinfer import CONFIGS, run_config  # noqa: E402


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eager_capture_replay_match_the_reference(name):
    config = replace(CONFIGS[name], max_batch=16, sizes=(1, 2, 4, 8, 16), max_context=1024)
    report = run_config(name, config, torch.device("cuda"), sequences=16, seed=1)
    assert report.ok, report.to_json()


@pytest.mark.parametrize("name", ["decode_p1_gqa", "decode_p16_mha", "mla_p64", "mla_p64_verify"])
def test_graph_slots_replay_through_the_proven_scheduler_call(name):
    """With flashinfer-python 0.5.3 every graph slot of these configurations passes the
    capture-time proof, a replay (the provider called with ``static=True``) re-plans its
    slot through the direct scheduler call and never through ``plan()``, and that call
    leaves the same plan info and pinned workspace bytes as the wrapper's own plan() of
    the same host arrays."""
    import random

    from backends.flashinfer import release_wrappers
    from backends.flashinfer.direct_plan import as_list
    from benchmarks.verify.flashinfer import build, make_batch

    config = replace(CONFIGS[name], max_batch=16, sizes=(1, 4, 16), max_context=1024)
    device = torch.device("cuda")
    release_wrappers()
    try:
        setup = build(config, device, seed=3)
        planner = setup.planner
        captured = {
            bs: planner.capture(bs, config.mode, req_to_token=setup.table) for bs in config.sizes
        }
        slots = [plans[config.backend].wrapper.slot for plans in captured.values()]
        assert all(slot.direct is not None for slot in slots)
        full_plans = []  # plan() calls after capture, by slot
        for slot in slots:
            own = slot.wrapper.plan

            def counted(*args, own=own, slot=slot, **kwargs):
                full_plans.append(slot)
                return own(*args, **kwargs)

            slot.wrapper.plan = counted  # the direct call goes to the scheduler, not here
        rng = random.Random(5)
        for _ in range(12):
            batch = make_batch(rng, config, setup.table_cpu, setup.table)
            bs = min(s for s in config.sizes if s >= batch.bs)
            full_plans.clear()
            plans = planner.replay(batch, bs)
            torch.cuda.synchronize()
            assert not full_plans, "a replay called plan()"
            slot = plans[config.backend].wrapper.slot
            wrapper = slot.wrapper
            got = as_list(wrapper._plan_info), wrapper._pin_memory_int_workspace_buffer.clone()
            slot._plan_wrapper(plans[config.backend].kv_indices)
            torch.cuda.synchronize()
            want = as_list(wrapper._plan_info), wrapper._pin_memory_int_workspace_buffer
            assert got[0] == want[0]
            assert torch.equal(got[1], want[1])
    finally:
        release_wrappers()
