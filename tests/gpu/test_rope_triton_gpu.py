"""The rope kernels compiled for the GPU, on CUDA, at the model's shapes.

Skipped cleanly without CUDA. Three claims are checked:

- accuracy: bf16 results against the fp32 formula on the same bf16 inputs, within half a
  bf16 ulp (``rtol = 2**-8``: the only error is the one final rounding; ``atol = 1e-5``
  leaves room for a last-bit fp32 difference near zero); features the indexer does not
  rope are bit-equal to the input;
- exactness: bit-equal to the torch formula run on the same CUDA tensors, since the
  kernels launch with fp fusion off (no fma contraction) and round fp32 to bf16 to
  nearest even like torch;
- one launch per call, and a CUDA graph captured around the calls replays on new data
  copied into its static inputs to the same results as eager calls.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from dsv32_engine.models.config import DSV32Config  # noqa: E402
from dsv32_engine.models.layers.rope import (  # noqa: E402
    apply_rope_half,
    apply_rope_half_leading,
    apply_rope_half_leading_torch,
    apply_rope_half_torch,
    apply_rope_interleaved,
    apply_rope_interleaved_torch,
    rope_cos_sin,
    yarn_inv_freq,
)

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HEADS, INDEX_HEADS = 128, 64
TOL = {"rtol": 2**-8, "atol": 1e-5}


def _cos_sin(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = DSV32Config.full()
    inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    pos = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen)
    return rope_cos_sin(pos.to(DEV), inv)


def _inputs(gen: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    """The model's layouts: q_rope split from 192-wide heads, k_rope split from the 576-wide
    KV projection, the indexer's query heads and key."""
    q = torch.randn(rows, HEADS, 192, generator=gen).to(DEV, BF16)
    kv = torch.randn(rows, 576, generator=gen).to(DEV, BF16)
    return {
        "q_rope": q.split([128, 64], dim=-1)[1],
        "k_rope": kv.split([512, 64], dim=-1)[1],
        "index_q": torch.randn(rows, INDEX_HEADS, 128, generator=gen).to(DEV, BF16),
        "index_k": torch.randn(rows, 128, generator=gen).to(DEV, BF16),
    }


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_interleaved_bf16_accuracy_and_exactness(rows):
    gen = torch.Generator().manual_seed(rows)
    cos, sin = _cos_sin(gen, rows)
    inputs = _inputs(gen, rows)
    for name in ("q_rope", "k_rope"):
        x = inputs[name]
        got = apply_rope_interleaved(x, cos, sin)
        assert got.dtype == BF16 and got.shape == x.shape and got.is_contiguous(), name
        ref = apply_rope_interleaved_torch(x.float(), cos, sin)
        torch.testing.assert_close(got.float(), ref, **TOL, msg=name)
        assert torch.equal(got, apply_rope_interleaved_torch(x, cos, sin)), name


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_half_leading_bf16_accuracy_and_exactness(rows):
    gen = torch.Generator().manual_seed(100 + rows)
    cos, sin = _cos_sin(gen, rows)
    inputs = _inputs(gen, rows)
    for name in ("index_q", "index_k"):
        x = inputs[name]
        got = apply_rope_half_leading(x, cos, sin, 64)
        assert got.dtype == BF16 and got.shape == x.shape and got.is_contiguous(), name
        ref = apply_rope_half_torch(x[..., :64].float(), cos, sin)
        torch.testing.assert_close(got[..., :64].float(), ref, **TOL, msg=name)
        assert torch.equal(got[..., 64:], x[..., 64:]), name
        assert torch.equal(got, apply_rope_half_leading_torch(x, cos, sin, 64)), name
    pe = inputs["index_q"][..., :64]  # strided: the first 64 of each 128-wide head
    got = apply_rope_half(pe, cos, sin)
    torch.testing.assert_close(got.float(), apply_rope_half_torch(pe.float(), cos, sin), **TOL)
    assert torch.equal(got, apply_rope_half_torch(pe, cos, sin))


def test_fp32_inputs_stay_fp32():
    gen = torch.Generator().manual_seed(5)
    cos, sin = _cos_sin(gen, 9)
    k = torch.randn(9, 128, generator=gen).to(DEV)
    got = apply_rope_half_leading(k, cos, sin, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, apply_rope_half_leading_torch(k, cos, sin, 64), rtol=1e-6, atol=1e-6
    )


def test_each_call_is_one_kernel():
    gen = torch.Generator().manual_seed(6)
    cos, sin = _cos_sin(gen, 4)
    inputs = _inputs(gen, 4)
    calls = [
        lambda: apply_rope_interleaved(inputs["q_rope"], cos, sin),
        lambda: apply_rope_interleaved(inputs["k_rope"], cos, sin),
        lambda: apply_rope_half_leading(inputs["index_q"], cos, sin, 64),
        lambda: apply_rope_half_leading(inputs["index_k"], cos, sin, 64),
    ]
    for call in calls:
        call()  # compile outside the profile
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    for index, call in enumerate(calls):
        with torch.profiler.profile(activities=activities) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if not kernels:
            pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI?)")
        assert len(kernels) == 1 and "rope" in kernels[0], (index, kernels)


def test_graph_replay_on_new_data_matches_eager():
    rows = 5
    gen = torch.Generator().manual_seed(7)
    cos, sin = _cos_sin(gen, rows)
    static = _inputs(gen, rows)

    def step() -> list[torch.Tensor]:
        return [
            apply_rope_interleaved(static["q_rope"], cos, sin),
            apply_rope_interleaved(static["k_rope"], cos, sin),
            apply_rope_half_leading(static["index_q"], cos, sin, 64),
            apply_rope_half_leading(static["index_k"], cos, sin, 64),
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for seed in range(3):
        gen = torch.Generator().manual_seed(1000 + seed)
        new_cos, new_sin = _cos_sin(gen, rows)
        fresh = _inputs(gen, rows)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        for name, view in static.items():
            view.copy_(fresh[name])  # into the captured views (and their parents)
        graph.replay()
        torch.cuda.synchronize()
        eager = [
            apply_rope_interleaved_torch(fresh["q_rope"], new_cos, new_sin),
            apply_rope_interleaved_torch(fresh["k_rope"], new_cos, new_sin),
            apply_rope_half_leading_torch(fresh["index_q"], new_cos, new_sin, 64),
            apply_rope_half_leading_torch(fresh["index_k"], new_cos, new_sin, 64),
        ]
        kernel = step()  # eager kernel calls on the same static inputs
        for index, (got, want, again) in enumerate(zip(outs, eager, kernel)):
            assert torch.equal(got, again), (seed, index)
            assert torch.equal(got, want), (seed, index)
