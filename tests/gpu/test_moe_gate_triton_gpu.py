"""The router and dispatch kernels compiled for the GPU: torch's choices and bits, two
launches, capturable.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_moe_gate_triton.py``)
check the selection logic, ties and the sum order; these check the compiled numerics
against the torch routing on CUDA, from bf16 logits of a real gate GEMM.

Tolerance. torch's ``topk`` orders ties arbitrarily on CUDA, so a row may differ from torch
only where the biased scores tie exactly (checked: the chosen values, slot by slot, are
torch's). Everywhere else the experts and their order are torch's. The weights were torch's
bits at 1 row but not from 16 rows on, in the last bits (r6-3; see ``moe_gate_triton``), so
they are held to 1e-6 relative and the MoE output to 1e-3 relative norm; the dispatch is
compared exactly.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers import moe_routing  # noqa: E402
from dsv32_engine.models.layers.exact import contract  # noqa: E402
from dsv32_engine.models.layers.ffn import Gate, MoE  # noqa: E402
from dsv32_engine.models.layers.moe_dispatch_triton import sort_by_expert_triton  # noqa: E402
from dsv32_engine.models.layers.moe_gate_triton import route_reference, route_triton  # noqa: E402
from dsv32_engine.models.layers.moe_routing import (  # noqa: E402
    dispatch_takes_kernel,
    sort_by_expert,
    sort_by_expert_torch,
)

DEV = torch.device("cuda")
BF16 = torch.bfloat16
REAL_ROUTING = {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


def _cfg(base: DSV32Config, **update) -> DSV32Config:
    return DSV32Config(**{**base.model_dump(), **update})


def _gate(cfg: DSV32Config, seed: int) -> Gate:
    """Logits of a few units and a correction bias of a tenth, like a trained router's."""
    torch.manual_seed(seed)
    gate = Gate(cfg, BF16).to(DEV).requires_grad_(False)
    torch.nn.init.normal_(gate.weight, std=2 * cfg.hidden_size**-0.5)
    torch.nn.init.normal_(gate.bias, std=0.1)
    return gate


def _x(rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, dim, device=DEV, generator=gen).to(BF16)


def _torch_route(gate: Gate, x: torch.Tensor):
    """The torch path on CUDA: the fp32 logits and ``route_reference``'s routing."""
    logits = contract("rd,ed->re", x, gate.weight, dtype=torch.float32)
    route = (gate.bias, gate.top_k, gate.n_group, gate.topk_group, gate.route_scale)
    return logits, route_reference(logits, *route)


def _assert_torch_choices(got, want, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """torch's experts in torch's order bar exact ties, and its weights on those rows; the
    rows that agree fully (a mask) are returned."""
    (got_w, got_i), (want_w, want_i) = got, want
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    same = (got_i == want_i).all(1)
    biased = torch.sigmoid(logits) + bias
    # Where a row differs, slot by slot the kernel's experts score exactly as torch's did.
    assert torch.equal(biased.gather(1, got_i)[~same], biased.gather(1, want_i)[~same])
    torch.testing.assert_close(got_w[same], want_w[same], rtol=1e-6, atol=0)
    return same


@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_router_matches_torch_at_the_real_shape(rows: int) -> None:
    """DeepSeek-V3.2's router: 7168 features, 256 experts in 8 groups, top 4 groups, top 8."""
    gate = _gate(DSV32Config.full(), rows)
    x = _x(rows, gate.weight.shape[1], rows)
    with torch.no_grad():
        assert gate.takes_kernel(x)
        got = gate(x)
        logits, want = _torch_route(gate, x)
    _assert_torch_choices(got, want, logits, gate.bias)


@pytest.mark.parametrize(
    "routing",
    [
        {},  # the small preset: 16 experts, 4 groups, top 2 groups, top 4
        {"n_group": 1, "topk_group": 1},
        {"n_routed_experts": 24, "num_experts_per_tok": 6, "n_group": 3, "topk_group": 2},
    ],
    ids=["small", "no_groups", "odd_groups"],
)
def test_router_matches_torch_on_small_configs(routing: dict) -> None:
    gate = _gate(_cfg(DSV32Config.small(), **routing), 5)
    x = _x(64, gate.weight.shape[1], 5)
    with torch.no_grad():
        got = gate(x)
        logits, want = _torch_route(gate, x)
    _assert_torch_choices(got, want, logits, gate.bias)


def test_router_ties_go_to_the_lower_id() -> None:
    """Equal logits everywhere: the first four groups, then their first eight experts, at
    equal weights (0.5 / 4 * 2.5, exact); and logits from a few values against stable sorts."""
    bias = torch.zeros(256, device=DEV)
    weights, indices = route_triton(torch.zeros(3, 256, device=DEV, dtype=BF16), bias, 8, 8, 4, 2.5)
    assert (indices == torch.arange(8, device=DEV)).all()
    assert (weights == 0.3125).all()
    gen = torch.Generator(device=DEV).manual_seed(3)
    logits = torch.randint(-2, 3, (64, 256), device=DEV, generator=gen).float()
    biased = torch.sigmoid(logits)
    grouped = biased.unflatten(-1, (8, -1))
    top2 = grouped.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    kept = top2.sort(dim=-1, descending=True, stable=True).indices[:, :4]
    mask = torch.zeros_like(top2, dtype=torch.bool).scatter_(1, kept, True)
    masked = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(-2)
    want = masked.sort(dim=-1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(route_triton(logits, bias, 8, 8, 4, 2.5)[1], want)


@pytest.mark.parametrize("rows", [1, 16, 64, 128, 1024])
def test_dispatch_matches_the_torch_sort(rows: int) -> None:
    """From the router's own output; 1024 rows at top-8 is the kernel's largest launch (8192
    pairs), past what the model hands it (``KERNEL_PAIRS``)."""
    gate = _gate(DSV32Config.full(), rows + 1)
    with torch.no_grad():
        weights, indices = gate(_x(rows, gate.weight.shape[1], rows + 1))
    assert dispatch_takes_kernel(weights, indices, 256) == (rows * 8 <= moe_routing.KERNEL_PAIRS)
    _assert_same_batch(weights, indices, 256)
    crowded = torch.tensor([[6, 0]] * 9, device=DEV)  # two experts busy, the rest idle
    _assert_same_batch(torch.rand(9, 2, device=DEV), crowded, 8)


def _assert_same_batch(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> None:
    got = sort_by_expert_triton(weights, indices, experts)
    want = sort_by_expert_torch(weights, indices, experts)
    for field, value in zip(("order", "rows", "weights", "ends"), got, strict=True):
        assert torch.equal(value, getattr(want, field)), field


def _moe(seed: int) -> MoE:
    """The small preset with the real routing shape, weights scaled by fan-in."""
    torch.manual_seed(seed)
    moe = MoE(_cfg(DSV32Config.small(), **REAL_ROUTING), BF16).to(DEV).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0, p.shape[-1] ** -0.5)
    moe.gate.bias.normal_(0, 0.1)
    return moe


def _torch_routing(monkeypatch) -> None:
    """Route with the torch formulas on CUDA, as before the kernels."""
    monkeypatch.setattr(Gate, "takes_kernel", lambda self, x: False)
    monkeypatch.setattr(moe_routing, "dispatch_takes_kernel", lambda *args: False)


@pytest.mark.parametrize("rows", [16, 64])
def test_moe_forward_matches_the_torch_routing(monkeypatch, rows: int) -> None:
    moe = _moe(rows)
    x = _x(rows, moe.w1.shape[2], rows)
    with torch.no_grad():
        assert moe.gate.takes_kernel(x)
        route = moe.gate(x)
        got = moe(x)
        _torch_routing(monkeypatch)
        logits, want_route = _torch_route(moe.gate, x)
        want = moe(x)
    same = _assert_torch_choices(route, want_route, logits, moe.gate.bias)
    err = (got[same].float() - want[same].float()).norm() / want[same].float().norm()
    assert err < 1e-3


def _kernels(fn) -> list[str]:
    fn()  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler saw no CUDA activity")
    return names


def test_routing_is_two_launches() -> None:
    """One launch after the gate GEMM for the router, one for the dispatch."""
    gate = _gate(DSV32Config.full(), 9)
    x = _x(16, gate.weight.shape[1], 9)
    with torch.no_grad():
        gemm = _kernels(lambda: contract("rd,ed->re", x, gate.weight, dtype=BF16))
        routed = _kernels(lambda: gate(x))
        assert len(routed) == len(gemm) + 1, routed
        weights, indices = gate(x)
        names = _kernels(lambda: sort_by_expert(weights, indices, 256))
    assert len(names) == 1 and "dispatch" in names[0], names


def test_capture_and_replay_with_new_inputs() -> None:
    """The router and dispatch alone, then the whole MoE, captured and replayed on new x."""
    moe = _moe(7)
    x = _x(64, moe.w1.shape[2], 7)
    with torch.no_grad():
        moe(x)  # compile / warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            weights, indices = moe.gate(x)
            batch = sort_by_expert(weights, indices, 256)
            y = moe(x)
        x.copy_(_x(64, moe.w1.shape[2], 8))
        graph.replay()
        torch.cuda.synchronize()
        eager_w, eager_i = moe.gate(x)
        assert torch.equal(weights, eager_w) and torch.equal(indices, eager_i)
        want = sort_by_expert_torch(eager_w, eager_i, 256)
        for field in ("order", "rows", "weights", "ends"):
            assert torch.equal(getattr(batch, field), getattr(want, field)), field
        assert torch.equal(y, moe(x))  # replay is the eager result, bit for bit
        logits, torch_route = _torch_route(moe.gate, x)
    _assert_torch_choices((eager_w, eager_i), torch_route, logits, moe.gate.bias)
