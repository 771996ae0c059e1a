"""The bf16-terms fp32 projection compiled on the GPU: within 2**-16 of the largest output
of the float64 product (tensor-core accumulation; cuBLAS's fp32 GEMM measured ~4x closer,
a bf16 weight ~500x farther), and capturable in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from dsv32_engine.models.layers.bf16_terms import Bf16TermsProjection, mm_fp32_out_available  # noqa: E402

DEV = torch.device("cuda")


def _setup(rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(7168, 64, bias=False).to(DEV).requires_grad_(False)
    linear.weight.copy_((torch.randn(64, 7168, generator=gen) * 0.02).to(DEV))
    x = torch.randn(rows, 7168, generator=gen).to(device=DEV, dtype=torch.bfloat16)
    return linear, x


@pytest.mark.skipif(not mm_fp32_out_available(DEV), reason="no bf16 -> fp32 torch.mm here")
@pytest.mark.parametrize("rows", [1, 16, 64, 200])
def test_close_to_the_fp32_product(rows: int) -> None:
    linear, x = _setup(rows, rows)
    exact = x.double() @ linear.weight.double().t()
    got = Bf16TermsProjection(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 64)
    top = exact.abs().max().item()
    err = (got.double() - exact).abs().max().item()
    err_w16 = (x.float() @ linear.weight.bfloat16().float().t()).double().sub(exact)
    # Tensor-core fp32 accumulation: about 2**-19 of the largest output in the benchmark (module
    # docstring); 2**-16 leaves room, and it stays far below a bf16 weight's error.
    assert err <= 2**-16 * top, (err, top)
    assert err * 16 < err_w16.abs().max().item()


@pytest.mark.skipif(not mm_fp32_out_available(DEV), reason="no bf16 -> fp32 torch.mm here")
def test_captured_projection_replays_over_new_inputs() -> None:
    linear, x = _setup(16)
    proj = Bf16TermsProjection(linear)
    static = x.clone()
    proj(static)  # terms made outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        proj(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = proj(static)
    fresh = torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, proj(fresh))


@pytest.mark.skipif(not mm_fp32_out_available(DEV), reason="no bf16 -> fp32 torch.mm here")
def test_terms_first_made_inside_a_capture_are_refused() -> None:
    """Made in a capture, the terms would be computed only when the graph replays: every
    other forward before that would read them unwritten. A graph's warm-up makes them."""
    from planner.errors import GraphSafetyError

    linear, x = _setup(16)
    proj = Bf16TermsProjection(linear)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphSafetyError, match="bf16 weight terms"), torch.cuda.graph(graph):
        proj(x)
    torch.testing.assert_close(proj(x), x.float() @ linear.weight.t(), rtol=1e-3, atol=1e-3)
