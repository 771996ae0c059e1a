"""The Triton RMSNorm compiled for the GPU: bf16 accuracy, CUDA graphs, one variant a run.

Skipped cleanly without CUDA. The interpreter tests (``tests/models/test_norm_triton.py``)
check the indexing; these check what only a GPU shows: the compiled kernel's fp32 numerics
(its rsqrt is the hardware approximation, its sum a tree), that ``RMSNorm.forward`` really
takes the kernel, that one launch captured in a ``torch.cuda.CUDAGraph`` replays over
fresh inputs, and that new row counts or strides reuse the compiled variant.

Tolerances. The kernel computes in fp32 and rounds once to bf16, so each output is within
half a bf16 ulp (a relative 2**-8) of the exact value, plus ~1e-6 of fp32 error; against
the fp32 reference the bound used is one bf16 ulp, ``rtol = 2**-7``. The torch bf16 path
rounds the same way, so the two differ by at most one ulp, and only where the fp32 errors
straddle a rounding boundary: rarely (under 1% of elements is asserted).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import dsv32_engine.models.layers.norm as norm_module  # noqa: E402
from dsv32_engine.models.layers import norm_triton  # noqa: E402
from dsv32_engine.models.layers.norm import RMSNorm, rms_norm_reference  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-6
BF16_TOL = {"rtol": 2**-7, "atol": 1e-6}  # one bf16 ulp; see the module docstring
FP32_TOL = {"rtol": 1e-5, "atol": 1e-7}  # fp32 in, fp32 out: approximate rsqrt, tree sum
WIDTHS = [7168, 1536, 512]  # hidden, q_lora, kv_lora


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    """Make ``RMSNorm.forward`` fail if it falls back to the torch formula on CUDA; the
    tests' own reference is the function imported above, which this does not touch."""

    def torch_path(*args, **kwargs):
        raise AssertionError("RMSNorm took the torch path on CUDA")

    monkeypatch.setattr(norm_module, "rms_norm_reference", torch_path)


def _norm(d: int, seed: int) -> RMSNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(d, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=gen) * 2.0 - 0.5)
    return norm.to(DEV).requires_grad_(False)  # as the serving model holds it


def _randn(seed: int, *shape: int, scale: float = 1.0, dtype=BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def _fp32_reference(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return rms_norm_reference(x.float(), norm.weight, norm.eps)


def _check_bf16(out: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> None:
    assert out.dtype == BF16 and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), _fp32_reference(x, norm), **BF16_TOL)
    torch_bf16 = rms_norm_reference(x, norm.weight, norm.eps)  # fp32 math, bf16 out
    torch.testing.assert_close(out.float(), torch_bf16.float(), **BF16_TOL)
    assert (out != torch_bf16).float().mean().item() < 0.01


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", [1, 7, 64, 333])
@pytest.mark.parametrize("scale", [1e-2, 1.0, 30.0])
def test_bf16_forward_is_within_one_ulp_of_fp32(d: int, rows: int, scale: float) -> None:
    norm = _norm(d, seed=d)
    x = _randn(rows * 7 + d, rows, d, scale=scale)
    _check_bf16(norm(x), x, norm)


def test_fp32_forward_matches_fp32_reference() -> None:
    norm = _norm(7168, seed=1)
    x = _randn(2, 9, 7168, dtype=torch.float32)
    torch.testing.assert_close(norm(x), _fp32_reference(x, norm), **FP32_TOL)


def test_split_view_and_leading_dims_on_cuda() -> None:
    """The MLA latent is a split of ``wkv_a``'s 576-wide rows; decode batches come as
    ``[rows, D]``, MTP and tests may pass ``[batch, seq, D]``."""
    norm = _norm(512, seed=2)
    both = _randn(3, 40, 512 + 64)
    latent, _ = both.split([512, 64], dim=-1)
    _check_bf16(norm(latent), latent, norm)
    x3 = _randn(4, 2, 5, 512)
    _check_bf16(norm(x3), x3, norm)


def test_autograd_still_gets_the_torch_formula(monkeypatch) -> None:
    """The kernel has no backward: a weight that needs a gradient keeps the torch path."""
    monkeypatch.setattr(norm_module, "rms_norm_reference", rms_norm_reference)
    norm = RMSNorm(64, EPS).to(DEV)
    out = norm(_randn(5, 3, 64))
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert norm.weight.grad is not None


@pytest.mark.parametrize("d, width", [(7168, 7168), (512, 576)])
def test_captured_call_replays_over_new_inputs(d: int, width: int) -> None:
    """One call captured into a graph, replayed with new data copied into the static input
    (a split view when ``width > d``): equal to an eager call on the same data (same kernel,
    same launch), and within bf16 tolerance of the fp32 reference."""
    norm = _norm(d, seed=3)
    buffer = torch.zeros(16, width, device=DEV, dtype=BF16)
    static_x = buffer[:, :d]
    static_x.copy_(_randn(0, 16, d))

    side = torch.cuda.Stream()  # warm up (compile) off the capture, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        norm(static_x)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = norm(static_x)

    for seed in range(1, 5):
        fresh = _randn(seed, 16, d, scale=float(seed))
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, norm(fresh))
        _check_bf16(static_out, fresh, norm)


def _compiled_variants() -> int:
    jit = norm_triton._rms_norm._variants.get(False)
    caches = getattr(jit, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled variants elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_new_row_counts_and_strides_reuse_the_compiled_variant() -> None:
    """Serving changes the row count every batch; a compile then would stall a step."""
    norm = _norm(7168, seed=4)
    norm(_randn(0, 2, 7168))
    before = _compiled_variants()
    for rows in (1, 3, 64, 257):
        norm(_randn(rows, rows, 7168))
    wide = _randn(9, 5, 7168 + 64)  # another row stride, same 16-byte alignment
    norm(wide[:, :7168])
    norm(wide[:, 64:])
    torch.cuda.synchronize()
    assert _compiled_variants() == before


@pytest.mark.parametrize("rows", [1, 16, 64, 200])
def test_residual_add_fused_equals_add_then_norm_in_bf16(rows: int) -> None:
    """The decoder's ``add_rms_norm``: the sum rounded as torch's bf16 add rounds it, and the
    norm of those bits, both equal to the two separate launches bit for bit."""
    from dsv32_engine.models.layers.residual import add_rms_norm

    norm = _norm(7168, seed=rows)
    h = _randn(rows, rows, 7168, scale=4.0)
    delta = _randn(rows + 1, rows, 7168)
    total, normed = add_rms_norm(h, delta, norm)
    want = h + delta
    assert torch.equal(total, want)
    assert torch.equal(normed, norm_triton.rms_norm_triton(want, norm.weight, norm.eps))
