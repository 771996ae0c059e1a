"""The SwiGLU kernel compiled for the GPU: torch's bits, one launch, capturable.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_swiglu_triton.py``)
check indexing and where the two roundings happen; these check the compiled numerics
against torch's own CUDA kernels (``F.silu`` then the multiply), on every finite bf16 gate
value and at the model's shapes, plus the module paths and graph replay.

Tolerance. With libdevice's exp (``HAS_LIBDEVICE_EXP``), the CUDA ``expf`` torch calls, and
IEEE division, the kernel is expected bit-equal to torch. Without it (``tl.exp``, a few
fp32 ulps off) an activation may round the other way: then results are held to one bf16
ulp of torch's and mismatches to under 0.1% of elements.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers import moe_routing, swiglu_triton  # noqa: E402
from dsv32_engine.models.layers.ffn import MLP, MoE  # noqa: E402
from dsv32_engine.models.layers.swiglu_triton import HAS_LIBDEVICE_EXP, silu_mul_triton  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
ULP = {"rtol": 2**-7, "atol": 1e-30}


def _torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the model computed on CUDA before the kernel: two torch kernels."""
    return F.silu(gate) * up


def _assert_torch_bits(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    want = _torch(gate, up)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if HAS_LIBDEVICE_EXP:
        assert torch.equal(got, want)
        return
    torch.testing.assert_close(got.float(), want.float(), **ULP)
    assert (got != want).float().mean().item() < 1e-3


def test_every_finite_bf16_gate_value() -> None:
    """All 65536 bf16 bit patterns bar NaN and inf, against random ``up`` (and ``up = 1``,
    which exposes the activation's own rounding)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = bits.view(BF16)
    gate = gate[torch.isfinite(gate)].to(DEV).view(1, -1)
    gen = torch.Generator().manual_seed(0)
    up = (torch.randn(gate.shape, generator=gen) * 3).to(DEV, BF16)
    _assert_torch_bits(silu_mul_triton(gate, up), gate, up)
    ones = torch.ones_like(gate)
    _assert_torch_bits(silu_mul_triton(gate, ones), gate, ones)


@pytest.mark.parametrize("inter", [2048, 18432, 1000])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_fused_halves_at_model_shapes(rows: int, inter: int) -> None:
    """``MLP``'s fused ``[rows, 2 * inter]`` GEMM output, read in place."""
    gen = torch.Generator().manual_seed(rows + inter)
    both = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(DEV, BF16)
    gate, up = both.split(inter, dim=-1)
    _assert_torch_bits(silu_mul_triton(gate, up), gate, up)
    # and within one ulp of the two roundings done on exact values
    act = F.silu(gate.double()).to(BF16).double()
    torch.testing.assert_close(silu_mul_triton(gate, up).double(), act * up.double(), **ULP)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate = (torch.randn(33, 2048, generator=gen) * 4).to(DEV, dtype)
    up = torch.randn(33, 2048, generator=gen).to(DEV, dtype)
    _assert_torch_bits(silu_mul_triton(gate, up), gate, up)


def test_captured_call_replays_over_new_inputs() -> None:
    inter = 2048
    both = torch.zeros(16, 2 * inter, device=DEV, dtype=BF16)
    gate, up = both.split(inter, dim=-1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        silu_mul_triton(gate, up)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = silu_mul_triton(gate, up)
    for seed in range(1, 4):
        gen = torch.Generator().manual_seed(seed)
        both.copy_((torch.randn(16, 2 * inter, generator=gen) * seed).to(DEV, BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, silu_mul_triton(gate, up))
        _assert_torch_bits(static_out, gate, up)


def _counting(monkeypatch) -> list[int]:
    """Count kernel launches through the model's dispatch; fail if it falls back."""
    calls: list[int] = []
    real = swiglu_triton.silu_mul_triton

    def counted(gate, up):
        calls.append(1)
        return real(gate, up)

    def fallback(*args, **kwargs):
        raise AssertionError("silu_mul fell back to the torch silu on CUDA")

    monkeypatch.setattr(swiglu_triton, "silu_mul_triton", counted)
    monkeypatch.setattr(swiglu_triton, "silu", fallback)
    return calls


@pytest.mark.parametrize("fuse", [False, True])
def test_mlp_takes_the_kernel_with_the_old_bits(monkeypatch, fuse: bool) -> None:
    with torch.device(DEV):
        torch.manual_seed(2)
        mlp = MLP(1024, 2048, BF16).requires_grad_(False)
        for p in mlp.parameters():
            torch.nn.init.normal_(p, std=0.03)
    if fuse:
        mlp.fuse_projections()
    x = torch.randn(16, 1024, device=DEV, dtype=BF16)
    parts = mlp.gate_up(x) if fuse else (mlp.w1(x), mlp.w3(x))
    want = mlp.w2(_torch(*parts))
    calls = _counting(monkeypatch)
    assert torch.equal(mlp(x), want)
    assert len(calls) == 1


def test_routed_experts_take_the_kernel_with_the_old_bits(monkeypatch) -> None:
    """Between the grouped GEMMs of the routed experts (and in the shared expert)."""
    cfg = DSV32Config.preset("small")
    with torch.device(DEV):
        torch.manual_seed(3)
        moe = MoE(cfg, BF16).requires_grad_(False)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.03)
    x = torch.randn(16, cfg.hidden_size, device=DEV, dtype=BF16)
    monkeypatch.setattr(moe_routing, "silu_mul", _torch)
    monkeypatch.setattr(
        moe.shared, "forward", lambda h: moe.shared.w2(_torch(moe.shared.w1(h), moe.shared.w3(h)))
    )
    want = moe(x)
    monkeypatch.undo()
    calls = _counting(monkeypatch)
    assert torch.equal(moe(x), want)
    assert len(calls) == 2  # routed and shared
