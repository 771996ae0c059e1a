"""Pieces of benchmarks/bench_sparse_mla.py: random batches, graph timing, ceilings, FlashInfer.

Kept apart so the benchmark's main file reads as the comparison it runs. Every
timer here warms up first (compilation and JIT stay out of the numbers) and
reports medians; the graph timer flushes L2 before each replay because at small
batches the gathered KV (2.4 MB per row) would otherwise be served from the 50 MB
L2 on every repeat, which no serving step sees.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.nsa.attention import sparse_mla_decode

FLUSH_BYTES = 256 << 20


@dataclass
class Batch:
    q: torch.Tensor  # [rows, H, latent]
    q_rope: torch.Tensor  # [rows, H, rope]
    kv: torch.Tensor  # [slots, latent + rope]
    slots: torch.Tensor  # int32 [rows, topk], -1 holes and -1 past lens
    lens: torch.Tensor  # int32 [rows]: min(kv_len, topk)
    scale: float


def softmax_scale() -> float:
    """DeepSeek-V3.2's: 192^-0.5 with the YaRN factor-40 correction squared."""
    return 192**-0.5 * (0.1 * math.log(40) + 1) ** 2


def make_kv(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """One bf16 KV cache of ``args.slots`` rows (unit-variance values, like the normed latent)."""
    kv = torch.randn(args.slots, args.latent + args.rope, generator=gen)
    return kv.to(device=device, dtype=torch.bfloat16)


def make_batch(
    args: argparse.Namespace,
    rows: int,
    device: torch.device,
    gen: torch.Generator,
    kv: torch.Tensor,
    *,
    holes: float = 0.0,
    lens: str = "full",
) -> Batch:
    """Random queries and slots as the indexer leaves them (-1 past each row's length).

    ``lens="full"``: every row at top-k (steady-state decode past 2048 tokens);
    ``"random"``: a tenth empty, four tenths full, the rest uniform in [1, topk].
    """
    topk = args.topk
    if lens == "full":
        n = torch.full((rows,), topk, dtype=torch.int32)
    else:
        u = torch.rand(rows, generator=gen)
        n = torch.randint(1, topk + 1, (rows,), generator=gen, dtype=torch.int32)
        n = torch.where(u < 0.1, 0, torch.where(u < 0.5, topk, n)).to(torch.int32)
    slots = torch.randint(0, kv.shape[0], (rows, topk), generator=gen, dtype=torch.int32)
    slots[torch.rand(rows, topk, generator=gen) < holes] = -1
    slots[torch.arange(topk).unsqueeze(0) >= n.unsqueeze(1)] = -1
    q = torch.randn(rows, args.heads, args.latent, generator=gen)
    q_rope = torch.randn(rows, args.heads, args.rope, generator=gen)
    bf16 = torch.bfloat16
    return Batch(
        q.to(device, bf16),
        q_rope.to(device, bf16),
        kv,
        slots.to(device),
        n.to(device),
        softmax_scale(),
    )


def _stats(samples_us: list[float]) -> dict:
    s = sorted(samples_us)
    return {
        "median_us": statistics.median(s),
        "p99_us": s[min(len(s) - 1, (len(s) * 99) // 100)],
        "min_us": s[0],
        "iters": len(s),
    }


def time_graph(fn: Callable[[], object], args: argparse.Namespace) -> dict:
    """Capture ``fn`` once, replay it cold (L2 flushed before each), CUDA events around the
    replay only. The flush is queued first, so the host has long enqueued the replay
    before the GPU reaches it: launch latency stays out of the number."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(args.warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        graph.replay()
        e.record()
    hot_start, hot_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hot_start.record()
    for _ in range(args.iters):
        graph.replay()
    hot_end.record()
    torch.cuda.synchronize()
    out = _stats([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
    out["hot_mean_us"] = hot_start.elapsed_time(hot_end) * 1e3 / args.iters
    del graph
    return out


def time_eager(fn: Callable[[], object], args: argparse.Namespace) -> dict:
    """Wall clock of eager calls (the CPU smoke run; its numbers mean little)."""
    for _ in range(args.warmup):
        fn()
    samples = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _stats(samples)


def copy_bandwidth(device: torch.device) -> float:
    """TB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 tensor rate on random data: the compute ceiling (128 heads are ~240 FLOP/byte)."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def flashinfer_runner() -> Callable[[Batch], tuple[Callable[[], object], float]] | str:
    """A builder of FlashInfer page-1 MLA runs over a batch's valid slots, or why not.

    Per batch: fixed ``qo_indptr = arange(rows + 1)``, ``kv_indptr`` = cumsum of the
    valid counts, ``kv_indices`` = the valid slots row after row, ``kv_len_arr`` = the
    counts, in buffers handed to a ``use_cuda_graph=True`` wrapper; ``plan`` once, then
    the returned ``run`` is what gets captured. The latent and rope halves are copied
    into separate contiguous caches (FlashInfer's layout), once per KV cache.
    """
    try:
        import flashinfer  # optional GPU library: imported only when benchmarking it
    except Exception as e:  # noqa: BLE001 - a broken install is reported, not raised
        return f"flashinfer does not import: {type(e).__name__}: {e}"
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    split_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def build(b: Batch) -> tuple[Callable[[], object], float]:
        rows, heads, latent = b.q.shape
        rope = b.q_rope.shape[2]
        if b.kv.data_ptr() not in split_caches:
            split_caches.clear()
            split_caches[b.kv.data_ptr()] = (
                b.kv[:, :latent].contiguous().view(-1, 1, latent),
                b.kv[:, latent:].contiguous().view(-1, 1, rope),
            )
        ckv, kpe = split_caches[b.kv.data_ptr()]
        valid = b.slots >= 0
        counts = valid.sum(dim=1).to(torch.int32)
        kv_indptr = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")
        kv_indptr[1:] = torch.cumsum(counts, 0)
        kv_indices = b.slots[valid].to(torch.int32)
        qo_indptr = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        wrapper = flashinfer.BatchMLAPagedAttentionWrapper(
            workspace,
            use_cuda_graph=True,
            qo_indptr=torch.empty_like(qo_indptr),
            kv_indptr=torch.empty_like(kv_indptr),
            kv_indices=torch.empty(b.slots.numel(), dtype=torch.int32, device="cuda"),
            kv_len_arr=torch.empty_like(counts),
        )
        wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, counts, heads, latent, rope, 1, False,
            b.scale, b.q.dtype, b.kv.dtype,
        )  # fmt: skip
        out = torch.empty_like(b.q)

        def run() -> torch.Tensor:
            return wrapper.run(b.q, b.q_rope, ckv, kpe, out=out)

        run()
        ref = sparse_mla_decode(b.q.float(), b.q_rope.float(), b.kv, b.slots, b.scale)
        err = float((out.float() - ref).norm() / ref.norm())
        return run, err

    return build
