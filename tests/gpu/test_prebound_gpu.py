"""The metadata kernels launched prebound (``backends.common.lazy_kernel``) on a real GPU:
bit-equal to their torch references on random inputs, launch after launch, and actually
prebound (Triton's launcher only for each variant's first launch)."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends.common.lazy_kernel import PreboundLaunches  # noqa: E402
from planner.ops import get_op  # noqa: E402
from tests.backends.test_host_twins import CASES, garbage  # noqa: E402

DEV = torch.device("cuda")
TRITON_CASES = sorted(name for name in CASES if "triton" in get_op(name).providers)


def prebound_so_far() -> int:
    return sum(x.prebound for x in gc.get_objects() if isinstance(x, PreboundLaunches))


@pytest.mark.parametrize("name", TRITON_CASES)
def test_prebound_launches_equal_the_torch_reference(name):
    op = get_op(name)
    before = prebound_so_far()

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        shape, inputs, params = CASES[name](data.draw)
        start = torch.from_numpy(garbage(shape, data.draw))
        ref = start.clone()
        op.providers["torch"].fn(ref, *(torch.from_numpy(x.copy()) for x in inputs), **params)
        got = start.to(DEV)
        op.providers["triton"].fn(got, *(torch.from_numpy(x).to(DEV) for x in inputs), **params)
        assert torch.equal(got.cpu(), ref)

    check()
    assert prebound_so_far() > before, f"{name}: no launch was prebound"


def test_the_token_table_gathers_prebound_equal_the_reference():
    gather, pages = get_op("gather_token_slots"), get_op("page_table")
    before = prebound_so_far()
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 1 << 20, (33, 512), generator=gen, dtype=torch.int32)
    for step in range(30):
        reqs = 1 + step % 9
        pool = torch.randint(0, 33, (reqs,), generator=gen, dtype=torch.int32)
        lens = torch.randint(1, 513, (reqs,), generator=gen, dtype=torch.int32)
        width = int(lens.max())
        outs = []
        for device in ("cpu", DEV):
            kind = "torch" if device == "cpu" else "triton"
            slots = torch.full((reqs, width), -5, dtype=torch.int32, device=device)
            args = (table.to(device), pool.to(device), lens.to(device))
            gather.providers[kind].fn(slots, *args)
            page = torch.full((reqs, -(-width // 64)), -5, dtype=torch.int32, device=device)
            pages.providers[kind].fn(page, slots, page_size=64)
            outs.append((slots.cpu(), page.cpu()))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert prebound_so_far() >= before + 50
