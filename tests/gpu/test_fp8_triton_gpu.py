"""The fp8 per-vector quantisation kernel compiled for the GPU, against the torch recipe, on CUDA.

Skipped cleanly without CUDA. What the interpreter tests (tests/backends/test_fp8_triton.py,
whose case builders these reuse) cannot prove: the compiled kernel bit-equal to torch's own
CUDA ops (whose ratio is ``c * fp32(1/448)``, not ``c / 448``, and whose fp8 cast may be the
hardware one) over many random batches in the layouts the indexer uses, also bit-equal to
the CPU recipe; one launch per call; and a captured CUDA graph replaying it over new data.
NaN bytes are compared as NaN whatever their sign: the GPU's float ops and torch's
hardware fp8 cast (CUDA 13, sm_89+) may drop a NaN's sign, and where either does is not
the kernel's to choose.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends.deepgemm import fp8  # noqa: E402
from backends.deepgemm.fp8 import (  # noqa: E402
    quantize_fp8_e4m3_per_vector,
    quantize_fp8_e4m3_per_vector_reference,
)
from backends.deepgemm.fp8_triton import quantize_fp8_triton  # noqa: E402
from tests.backends.test_fp8_triton import (  # noqa: E402
    CENTRES,
    centre_vectors,
    extreme_vectors,
    random_vectors,
    special_vectors,
    tie_vectors,
)

DEV = torch.device("cuda")
HEADS = 64  # DeepSeek-V3.2's indexer heads: queries are [rows, 64, 128], keys [rows, 128]


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_same(got: tuple, want: tuple, *, nan_sign_free: bool = False) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    assert torch.equal(s.cpu().view(torch.int32), s_ref.cpu().view(torch.int32))
    a, b = _bytes(q).cpu(), _bytes(q_ref).cpu()
    if nan_sign_free:
        nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
        assert torch.equal(nan_a, nan_b)
        a, b = a[~nan_a], b[~nan_b]
    bad = a != b
    assert not bad.any(), (int(bad.sum()), a[bad][:8].tolist(), b[bad][:8].tolist())


def check(x: torch.Tensor, block: int = 128, *, cpu_too: bool = True) -> None:
    """Kernel (through the dispatcher and directly) against torch on CUDA, and on the CPU."""
    got = quantize_fp8_e4m3_per_vector(x, block)
    assert_same(got, quantize_fp8_triton(x, block))
    assert_same(got, quantize_fp8_e4m3_per_vector_reference(x, block))
    if cpu_too:  # CUDA arithmetic drops a NaN's sign (torch's own CUDA path too), the CPU keeps it
        want = quantize_fp8_e4m3_per_vector_reference(x.cpu(), block)
        assert_same(got, want, nan_sign_free=True)


def _batch(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A random indexer-like batch: keys [rows, 128], queries [rows, 64, 128], or
    [rows, k * 128], rows 1..300, each vector at its own magnitude."""
    rows = int(torch.randint(1, 301, (1,), generator=gen))
    shape = int(torch.randint(0, 3, (1,), generator=gen))
    if shape == 0:
        x = random_vectors(gen, rows, 1)
    elif shape == 1:
        x = random_vectors(gen, rows * HEADS, 1).view(rows, HEADS, 128)
    else:
        x = random_vectors(gen, rows, int(torch.randint(2, 5, (1,), generator=gen)))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).to(DEV)


def test_dispatcher_launches_the_kernel_on_cuda(monkeypatch) -> None:
    calls = []

    def spy(x, block):
        calls.append(x.shape)
        return quantize_fp8_triton(x, block)

    monkeypatch.setattr(fp8, "quantize_fp8_triton", spy)
    quantize_fp8_e4m3_per_vector(torch.randn(4, 128, device=DEV, dtype=torch.bfloat16))
    assert calls == [(4, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_random_batches_bit_equal(dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    for _ in range(60):
        check(_batch(gen, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_edge_cases_bit_equal(dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    for x in (centre_vectors(gen), tie_vectors(), extreme_vectors()):
        check(x.to(dtype).to(DEV))
    bf16_max = torch.finfo(torch.bfloat16).max
    check(torch.linspace(-bf16_max, bf16_max, 256, device=DEV).to(torch.bfloat16))
    # The centres land on +-448 with scale exactly 2**k.
    rows = slice(3 * len(CENTRES), 4 * len(CENTRES))
    q, s = quantize_fp8_e4m3_per_vector(centre_vectors(gen)[rows].to(DEV))
    assert (q.float().abs().amax(dim=1) == 448).all()
    assert torch.equal(s.squeeze(1).cpu(), CENTRES / 448)


@pytest.mark.parametrize("block", [64, 96, 256])
def test_other_block_sizes(block) -> None:
    gen = torch.Generator().manual_seed(block)
    for dtype in (torch.bfloat16, torch.float32):
        check(random_vectors(gen, 37, 2, block).to(dtype).to(DEV), block)


def test_strided_inputs_and_every_alignment() -> None:
    # Row strides and starts that give each ROW_ALIGN variant, and misaligned base pointers
    # (Triton compiles those without the 16-byte specialisation).
    gen = torch.Generator().manual_seed(13)
    for pad in (0, 1, 2, 4, 8, 36):
        wide = random_vectors(gen, 50, 3).to(torch.bfloat16).to(DEV)
        wide = torch.nn.functional.pad(wide, (0, pad))
        for start in (0, 1, 2, 4, 8):
            check(wide[:, start : start + 256])
    base = random_vectors(gen, 4 * 8 * 5, 1).view(4, 8, 5, 128).to(DEV)
    check(base[:, :, 2])  # leading dims collapse to one stride
    check(base[:, :5, 1:3])  # they do not: the launcher copies
    check(base.transpose(0, 1)[:, :, 0])
    check(random_vectors(gen, 1, 1).to(DEV).expand(7, 128))  # row stride 0
    q, s = quantize_fp8_e4m3_per_vector(torch.empty(0, HEADS, 128, device=DEV))
    assert q.shape == (0, HEADS, 128) and s.shape == (0, HEADS, 1)


def test_big_prefill_batch() -> None:
    # A long prefill's queries (8192 tokens, 64 Mi elements, half a million vectors):
    # many programs, and the launch still one.
    gen = torch.Generator(device=DEV).manual_seed(14)
    x = torch.randn(8192, HEADS, 128, device=DEV, generator=gen, dtype=torch.float32)
    x *= torch.rand(8192, HEADS, 1, device=DEV, generator=gen) * 100
    check(x, cpu_too=False)
    check(x.to(torch.bfloat16), cpu_too=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_vectors(dtype) -> None:
    x = special_vectors(torch.Generator().manual_seed(15)).to(dtype).to(DEV)
    got = quantize_fp8_e4m3_per_vector(x)
    assert (got[1] == 1).all()
    assert_same(got, quantize_fp8_e4m3_per_vector_reference(x), nan_sign_free=True)
    assert_same(got, quantize_fp8_e4m3_per_vector_reference(x.cpu()), nan_sign_free=True)


def test_one_kernel_launch_per_call() -> None:
    x = torch.randn(64, HEADS, 128, device=DEV, dtype=torch.bfloat16)
    quantize_fp8_e4m3_per_vector(x)  # compile outside the profile
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        quantize_fp8_e4m3_per_vector(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler saw no CUDA activity")
    assert len(kernels) == 1 and "quantize" in kernels[0], kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replay_over_new_batches(dtype) -> None:
    rows = 48
    gen = torch.Generator().manual_seed(16)
    static_q = torch.zeros(rows, HEADS, 128, device=DEV, dtype=dtype)
    static_k = torch.zeros(rows, 128, device=DEV, dtype=dtype)
    # Warm up (compiles the kernel) on a side stream, as capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            quantize_fp8_e4m3_per_vector(static_q)
            quantize_fp8_e4m3_per_vector(static_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q = quantize_fp8_e4m3_per_vector(static_q)
        out_k = quantize_fp8_e4m3_per_vector(static_k)
    for _ in range(8):
        new_q = random_vectors(gen, rows * HEADS, 1).view(rows, HEADS, 128).to(dtype).to(DEV)
        new_k = random_vectors(gen, rows, 1).to(dtype).to(DEV)
        static_q.copy_(new_q)
        static_k.copy_(new_k)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out_q, quantize_fp8_e4m3_per_vector_reference(new_q))
        assert_same(out_k, quantize_fp8_e4m3_per_vector_reference(new_k))


# ---- the rotated variant (the indexer's Hadamard fused into the launch) ----------------


def _rotated_torch(x: torch.Tensor, r: torch.Tensor) -> tuple:
    """The indexer's torch path on CUDA: fp32 GEMM, scale, bf16 cast, the torch recipe."""
    y = ((x.float() @ r.t()) * 128**-0.5).to(torch.bfloat16)
    return quantize_fp8_e4m3_per_vector_reference(y, 128)


@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_rotated_variant_bit_equal_on_exact_sums_and_rare_flips_otherwise(rows):
    from dsv32_engine.models.layers.hadamard import hadamard_matrix
    from tests.backends.test_fp8_rotate_triton import exact_sum_vectors

    gen = torch.Generator().manual_seed(rows)
    h = hadamard_matrix(128, device=DEV)
    for shape in ((rows, HEADS, 128), (rows, 128)):
        x = exact_sum_vectors(gen, shape).to(DEV)
        assert_same(quantize_fp8_triton(x, 128, rotation=h, rotation_scale=128**-0.5),
                    _rotated_torch(x, h))  # fmt: skip
        g = torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)
        (q, s), (q_ref, s_ref) = (
            quantize_fp8_triton(g, 128, rotation=h, rotation_scale=128**-0.5),
            _rotated_torch(g, h),
        )
        a, b = _bytes(q).int(), _bytes(q_ref).int()
        flips = a != b
        assert flips.float().mean().item() < 1e-3, int(flips.sum())
        assert ((a - b).abs()[flips] <= 1).all()
        assert torch.equal(s, s_ref) or (s != s_ref).float().mean().item() < 1e-3
