"""The router and dispatch kernels under Triton's interpreter, against the torch paths.

Under the interpreter the router's exp is numpy's (libdevice cannot be interpreted), so the
scores it is compared with come from numpy's fp32 ``1 / (1 + exp(-x))``: with those fed
to the torch selection (``select_experts``), indices must be identical, order included,
and weights bit-identical to the kernel's documented sum order (torch's CPU sum adds in
another order: within 1e-6 of it). Against the Gate's own CPU path (a float64 sigmoid)
the choices agree on random logits and the weights within 1e-6. Ties follow the kernel's
rule, lower id first, held against stable sorts. The dispatch only moves integers and
copies weights, so it is held bit-identical to ``sort_by_expert_torch``. The compiled
numerics are checked in ``tests/gpu/test_moe_gate_triton_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.ffn import Gate
from dsv32_engine.models.layers.moe_dispatch_triton import MAX_PAIRS, sort_by_expert_triton
from dsv32_engine.models.layers.moe_gate_triton import route_reference, route_triton, select_experts
from dsv32_engine.models.layers.moe_routing import dispatch_takes_kernel, sort_by_expert_torch
from tests.support.kernels import interpretable_stdlib

pytestmark = [pytest.mark.triton, interpretable_stdlib]

SCALE = 2.5
# (experts, top_k, n_group, topk_group): the real routing, small configs with and without
# groups, groups that are not a power of two wide or many, every group kept, top_k odd.
ROUTINGS = {
    "real": (256, 8, 8, 4),
    "e16_flat": (16, 4, 1, 1),
    "e16_groups": (16, 4, 4, 2),
    "e24_odd": (24, 6, 3, 2),
    "e12_all_kept": (12, 3, 4, 4),
    "e40_top1": (40, 1, 5, 1),
}


def _numpy_scores(logits: torch.Tensor) -> torch.Tensor:
    """The interpreter's sigmoid: numpy's fp32 exp, then an IEEE fp32 division."""
    x = logits.float().numpy()
    return torch.from_numpy(np.float32(1.0) / (np.float32(1.0) + np.exp(-x)))


def _tree_weights(scores: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel's normalisation, written out: lane i sums slots i and i + L (L the largest
    power of two <= k), then adjacent lanes pairwise, all in fp32."""
    s = scores.gather(1, indices).numpy()
    k = s.shape[1]
    lanes = 1 << (k.bit_length() - 1)
    t = [s[:, i] + s[:, i + lanes] if i + lanes < k else s[:, i] for i in range(lanes)]
    while len(t) > 1:
        t = [t[i] + t[i + 1] for i in range(0, len(t), 2)]
    return torch.from_numpy((s / t[0][:, None]) * np.float32(scale))


def _logits(rows: int, experts: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed)) * scale


def _bias(experts: int, seed: int) -> torch.Tensor:
    return torch.randn(experts, generator=torch.Generator().manual_seed(seed + 1000)) * 0.1


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).abs() / want.double().abs()).max())


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_router_matches_the_torch_selection(name: str, rows: int) -> None:
    experts, top_k, n_group, topk_group = ROUTINGS[name]
    logits, bias = _logits(rows, experts, rows), _bias(experts, rows)
    route = (top_k, n_group, topk_group, SCALE)
    weights, indices = route_triton(logits, bias, *route)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (rows, top_k)
    # The same scores through torch's selection: same experts, same (descending) order.
    scores = _numpy_scores(logits)
    want_w, want_i = select_experts(scores, bias, *route)
    assert torch.equal(indices, want_i)
    assert _rel(weights, want_w) < 1e-6
    assert torch.equal(weights, _tree_weights(scores, indices, SCALE))
    # And the Gate's own CPU path, float64 sigmoid and all.
    ref_w, ref_i = route_reference(logits, bias, *route)
    assert torch.equal(indices, ref_i)
    assert _rel(weights, ref_w) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_are_widened_exactly(dtype: torch.dtype) -> None:
    """The GEMM's bf16 output read as fp32: the same result as the fp32 copy the torch path
    makes, and the torch path's choices."""
    logits, bias = _logits(5, 256, 7).to(dtype), _bias(256, 7)
    got = route_triton(logits, bias, 8, 8, 4, SCALE)
    want = route_triton(logits.float(), bias, 8, 8, 4, SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[1], select_experts(_numpy_scores(logits), bias, 8, 8, 4, SCALE)[1])


def test_strided_logits_rows() -> None:
    """Rows of a wider buffer (row stride > E) read in place, as from a fused GEMM."""
    wide, bias = _logits(6, 300, 8), _bias(256, 8)
    view = wide[:, 20:276]
    assert view.stride(0) == 300
    got = route_triton(view, bias, 8, 8, 4, SCALE)
    want = route_triton(view.contiguous(), bias, 8, 8, 4, SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _rule_reference(scores, bias, top_k, n_group, topk_group, scale):
    """``select_experts`` with each top-k a stable descending sort: lower id first on ties."""
    biased = scores + bias
    if n_group > 1:
        grouped = biased.unflatten(-1, (n_group, -1))
        top2 = grouped.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        kept = top2.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros_like(top2, dtype=torch.bool).scatter_(1, kept, True)
        biased = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(-2)
    indices = biased.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    return _tree_weights(scores, indices, scale), indices


@pytest.mark.parametrize("name", ["real", "e16_groups", "e16_flat", "e24_odd"])
def test_ties_go_to_the_lower_id(name: str) -> None:
    """Logits and biases from a few values, so biased scores, group top-2s and group scores
    tie all over; and a row of equal logits, where the first groups and experts win."""
    experts, top_k, n_group, topk_group = ROUTINGS[name]
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-2, 3, (24, experts), generator=gen).float()
    logits[0] = 0.5
    route = (top_k, n_group, topk_group, SCALE)
    for bias in (torch.zeros(experts), torch.randint(0, 3, (experts,), generator=gen) * 0.25):
        got_w, got_i = route_triton(logits, bias, *route)
        want_w, want_i = _rule_reference(_numpy_scores(logits), bias, *route)
        assert torch.equal(got_i, want_i)
        assert torch.equal(got_w, want_w)
    got_w, got_i = route_triton(logits[:1], torch.zeros(experts), *route)
    assert got_i[0].tolist() == list(range(top_k))
    assert torch.allclose(got_w, torch.full_like(got_w, SCALE / top_k), rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    n_group=st.sampled_from([1, 2, 3, 4]),
    per_group=st.integers(2, 9),
    data=st.data(),
)
def test_router_any_small_routing(n_group: int, per_group: int, data: st.DataObject) -> None:
    """Any group count and width (not powers of two), topk_group and top_k they allow."""
    experts = n_group * per_group
    topk_group = data.draw(st.integers(1, n_group))
    eligible = experts if topk_group == n_group else topk_group * per_group
    top_k = data.draw(st.integers(1, eligible))
    rows = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**16))
    logits, bias = _logits(rows, experts, seed), _bias(experts, seed)
    route = (top_k, n_group, topk_group, SCALE)
    weights, indices = route_triton(logits, bias, *route)
    scores = _numpy_scores(logits)
    assert torch.equal(indices, select_experts(scores, bias, *route)[1])
    assert torch.equal(weights, _tree_weights(scores, indices, SCALE))


def test_router_rejects_what_it_cannot_route() -> None:
    logits, bias = torch.zeros(2, 16), torch.zeros(16)
    with pytest.raises(ValueError, match="groups"):
        route_triton(logits, bias, 2, 5, 2, SCALE)  # 16 experts do not split in 5
    with pytest.raises(ValueError, match="top_k"):
        route_triton(logits, bias, 9, 4, 2, SCALE)  # 2 groups of 4 hold 8
    with pytest.raises(ValueError, match="experts"):
        route_triton(torch.zeros(2, 512), torch.zeros(512), 8, 8, 4, SCALE)
    with pytest.raises(ValueError, match="bias"):
        route_triton(logits, torch.zeros(8), 2, 4, 2, SCALE)
    assert route_triton(torch.zeros(0, 16), bias, 2, 4, 2, SCALE)[1].shape == (0, 2)


def test_gate_keeps_the_torch_path_on_the_cpu() -> None:
    """The CPU model's routing is the torch formula's float64 sigmoid, not the kernel."""
    cfg = DSV32Config(
        **{**DSV32Config.tiny().model_dump(), "n_routed_experts": 16, "num_experts_per_tok": 4}
    )
    gate = Gate(cfg, torch.float32)
    torch.nn.init.normal_(gate.weight, std=0.3)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not gate.takes_kernel(x)
        weights, indices = gate(x)
        logits = torch.einsum("rd,ed->re", x.double(), gate.weight.double()).float()
        want = route_reference(logits, gate.bias, 4, cfg.n_group, cfg.topk_group, SCALE)
    assert torch.equal(weights, want[0]) and torch.equal(indices, want[1])


# ------------------------------------------------------------------------------ dispatch


def _routing(rows: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per row, as a gate picks them, and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.rand(rows, experts, generator=gen).argsort(1)[:, :top_k]
    return torch.rand(rows, top_k, generator=gen), indices


def _assert_same_batch(weights, indices, experts: int) -> None:
    got = sort_by_expert_triton(weights, indices, experts)
    want = sort_by_expert_torch(weights, indices, experts)
    for field, value in zip(("order", "rows", "weights", "ends"), got, strict=True):
        ref = getattr(want, field)
        assert value.dtype == ref.dtype and torch.equal(value, ref), field


@pytest.mark.parametrize("rows", [1, 3, 64, 128])
@pytest.mark.parametrize("top_k, experts", [(8, 256), (4, 16), (1, 5), (3, 24)])
def test_dispatch_matches_the_torch_sort(rows: int, top_k: int, experts: int) -> None:
    _assert_same_batch(*_routing(rows, top_k, experts, rows + experts), experts)


def test_dispatch_crowded_idle_and_int32() -> None:
    """Every row on the same experts (the rest idle, first and last among them), int32 ids,
    and the router's own output."""
    weights = torch.rand(9, 2)
    _assert_same_batch(weights, torch.tensor([[6, 0]] * 9), 8)
    _assert_same_batch(weights, torch.tensor([[3, 7]] * 9, dtype=torch.int32), 8)
    logits, bias = _logits(33, 256, 5), _bias(256, 5)
    _assert_same_batch(*route_triton(logits, bias, 8, 8, 4, SCALE), 256)


@pytest.mark.parametrize("n_pairs", [15, 16, 17, 512, 513, MAX_PAIRS])
def test_dispatch_pair_counts_at_block_edges(n_pairs: int) -> None:
    """Below, at and past the smallest block and a power of two, and the largest launch."""
    weights, indices = _routing(n_pairs, 1, 256, n_pairs)
    _assert_same_batch(weights, indices, 256)


def test_dispatch_limits_and_the_cpu_path() -> None:
    weights, indices = _routing(MAX_PAIRS + 1, 1, 16, 0)
    with pytest.raises(ValueError, match="pairs"):
        sort_by_expert_triton(weights, indices, 16)
    assert not dispatch_takes_kernel(weights, indices, 16)  # too many for one program
    assert not dispatch_takes_kernel(*_routing(4, 2, 16, 0), 16)  # CPU: the torch sort


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), top_k=st.integers(1, 6), spare=st.integers(0, 20))
def test_dispatch_any_small_routing(rows: int, top_k: int, spare: int) -> None:
    experts = top_k + spare
    _assert_same_batch(*_routing(rows, top_k, experts, rows * 100 + experts), experts)
