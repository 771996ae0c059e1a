#!/usr/bin/env python3
"""Sparse MLA decode: the Triton split-KV kernel against the torch reference and FlashInfer.

One call does the whole comparison (device time is short):

1. **Checks** on the device: the Triton split plan bit-equal to its torch reference over
   random batches; one capture of plan + kernel at a fixed size replayed over fresh
   batches (new lengths, slots and queries copied into the static buffers) bit-equal to
   eager calls -- the per-batch plan really is all that changes between batches.
2. **Accuracy**: relative error (Frobenius, per batch, and the worst row) of the kernel
   against the fp32 torch reference over ``--batches`` random batches (rows from
   ``--rows``, valid counts from 0 to top-k, -1 holes, flat and peaky logits, the chosen
   split count and forced ones). Fails above ``--tol`` (2e-2).
3. **Timing** under CUDA graphs at the real shape (full top-k, a few holes): each variant
   is captured, then replayed ``--iters`` times after a 256 MB L2 flush (so every replay
   reads its KV rows from HBM, as between layers in serving); CUDA events around the
   replay only; median and p99. Variants: the Triton kernel (each ``--configs`` entry),
   the torch reference, and FlashInfer's ``BatchMLAPagedAttentionWrapper`` at page size 1
   over the same valid slots (planned once with fixed buffers, if flashinfer imports).
4. **Bandwidth**: bytes (KV rows gathered + q + out) over time, next to a large
   device-to-device copy measured in the same run (read + write bytes), and the bf16
   tensor rate (one 8192^3 product): at 128 heads this problem is as much compute as
   bytes (about 240 FLOP per KV byte), so both ceilings are printed.

On the H200 (carry ``.whl`` from scripts/fetch_gpu_wheels.sh for pydantic + flashinfer)::

    source scripts/device_prelude.sh || exit 1; \\
    python3 -m benchmarks sparse_mla --out "$OUT" --plot "$OUT/sparse_mla.png"

``--smoke`` runs tiny shapes on the CPU under the Triton interpreter (eager timing, no
graphs, no FlashInfer): a test runs it so the script cannot rot.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GPU_STEPS = {
    "": "--out {out} --iters 50",
}

if "--smoke" in sys.argv and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402

from backends.nsa.attention import sparse_mla_decode  # noqa: E402
from backends.nsa.sparse_mla_plan import (  # noqa: E402
    CONFIGS,
    SparseMLAConfig,
    new_split_plan,
    new_workspace,
    sparse_mla_num_splits,
    split_plan_torch,
    split_plan_triton,
)
from backends.nsa.sparse_mla_ref import plain_reference  # noqa: E402
from backends.nsa.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402
from benchmarks.common import machine, num_sms_of, plot_bars, print_table, write_json  # noqa: E402

FLUSH_BYTES = 256 << 20


# ---------------------------------------------------------------------- batches, timers, ceilings
# Every timer here warms up first (compilation and JIT stay out of the numbers) and reports
# medians; the graph timer flushes L2 before each replay because at small batches the
# gathered KV (2.4 MB per row) would otherwise be served from the 50 MB L2 on every repeat,
# which no serving step sees.


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


# ---------------------------------------------------------------------- the comparison


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--slots", type=int, default=262144, help="KV cache rows")
    p.add_argument("--holes", type=float, default=0.02, help="-1 fraction in timed batches")
    p.add_argument("--batches", type=int, default=200, help="random accuracy batches in total")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--configs", choices=["default", "all"], default="all")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for bench_sparse_mla.json")
    p.add_argument("--plot", help="PNG bar chart of the medians")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.heads, args.latent, args.rope, args.topk = [1, 3], 4, 32, 16, 40
        args.slots, args.batches, args.iters, args.warmup = 256, 8, 2, 1
        args.configs, args.no_flashinfer = "default", True
    return args


def _configs(args: argparse.Namespace) -> list[SparseMLAConfig]:
    if args.smoke:
        return [SparseMLAConfig(block_n=16)]
    return list(CONFIGS) if args.configs == "all" else [CONFIGS[0]]


def _splits(args: argparse.Namespace, rows: int, config: SparseMLAConfig, sms: int) -> int:
    return sparse_mla_num_splits(rows, heads=args.heads, topk=args.topk, num_sms=sms, config=config)


def _run_triton(b: Batch, plan: torch.Tensor, ws: torch.Tensor, out: torch.Tensor, cfg) -> None:
    sparse_mla_decode_triton(
        b.q, b.q_rope, b.kv, b.slots, b.scale, split_plan=plan, out=out, workspace=ws, config=cfg
    )


def check_plans(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> dict:
    """Triton plan == torch plan, bit for bit, over random lengths and shapes."""
    mismatches = 0
    for i in range(50):
        n = int(torch.randint(0, 300, (1,), generator=gen))
        splits = int(torch.randint(1, 70, (1,), generator=gen))
        lens = torch.randint(-2, args.topk + 64, (n,), generator=gen, dtype=torch.int32)
        want = new_split_plan(n + i % 3, splits, device)
        got = torch.full_like(want, -5)
        split_plan_torch(want, lens.to(device), topk=args.topk, block_n=(16, 32, 64)[i % 3])
        split_plan_triton(got, lens.to(device), topk=args.topk, block_n=(16, 32, 64)[i % 3])
        mismatches += int(not torch.equal(got, want))
    return {"cases": 50, "mismatches": mismatches}


def check_replay(args, device, gen, kv, cfg: SparseMLAConfig, sms: int) -> dict:
    """One capture of plan + kernel; fresh batches through its static buffers == eager."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA graphs"}
    rows = max(args.rows[0], 2)
    splits = _splits(args, rows, cfg, sms)
    static = make_batch(args, rows, device, gen, kv, holes=0.1, lens="random")
    plan, ws = (
        new_split_plan(rows, splits, device),
        new_workspace(rows, splits, args.heads, args.latent, device),
    )
    out = torch.empty_like(static.q)

    def step() -> None:
        split_plan_triton(plan, static.lens, topk=args.topk, block_n=cfg.block_n)
        _run_triton(static, plan, ws, out, cfg)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    mismatches = 0
    for _ in range(8):
        fresh = make_batch(args, rows, device, gen, kv, holes=0.1, lens="random")
        for name in ("q", "q_rope", "slots", "lens"):
            getattr(static, name).copy_(getattr(fresh, name))
        graph.replay()
        eager_plan = new_split_plan(rows, splits, device)
        split_plan_torch(eager_plan, fresh.lens, topk=args.topk, block_n=cfg.block_n)
        eager = sparse_mla_decode_triton(
            fresh.q,
            fresh.q_rope,
            fresh.kv,
            fresh.slots,
            fresh.scale,
            split_plan=eager_plan,
            config=cfg,
        )
        torch.cuda.synchronize()
        mismatches += int(not (torch.equal(eager, out) and torch.equal(eager_plan, plan)))
    return {"rows": rows, "splits": splits, "replays": 8, "mismatches": mismatches}


def accuracy(args, device, gen, kv, cfg: SparseMLAConfig, sms: int) -> dict:
    """Relative error against the fp32 torch reference over many random batches (one
    cache, fresh queries and slots each)."""
    errors, worst_rows, fails = [], [], []
    for i in range(args.batches):
        rows = args.rows[i % len(args.rows)]
        b = make_batch(args, rows, device, gen, kv, holes=(0.0, 0.05, 0.3)[i % 3], lens="random")
        b.q.mul_((0.3, 1.0, 2.0)[(i // 3) % 3])  # flat to peaky softmax
        splits = (_splits(args, rows, cfg, sms), 1, 2 + i % 7)[i % 3]
        plan = new_split_plan(rows, splits, device)
        split_plan_torch(plan, b.lens, topk=args.topk, block_n=cfg.block_n)
        got = sparse_mla_decode_triton(
            b.q, b.q_rope, b.kv, b.slots, b.scale, split_plan=plan, config=cfg
        )
        ref = plain_reference(b.q, b.q_rope, b.kv, b.slots, b.scale, plan)
        diff, norm = (got.float() - ref).flatten(1).norm(dim=1), ref.flatten(1).norm(dim=1)
        empty = norm == 0
        bad_empty = bool((diff[empty] != 0).any()) or bool(got.isnan().any())
        err = float(diff.norm() / ref.norm().clamp(min=1e-30))
        worst = float((diff[~empty] / norm[~empty]).max()) if (~empty).any() else 0.0
        errors.append(err)
        worst_rows.append(worst)
        if err > args.tol or worst > args.tol or bad_empty:
            fails.append(
                {"batch": i, "rows": rows, "splits": splits, "err": err, "worst_row": worst}
            )
    errors_sorted = sorted(errors)
    return {
        "batches": len(errors),
        "tol": args.tol,
        "max_rel_err": max(errors),
        "median_rel_err": errors_sorted[len(errors) // 2],
        "max_row_rel_err": max(worst_rows),
        "failures": fails,
    }


def timing(args, device, gen, kv, configs, sms: int, copy_tbs: float) -> tuple[list[dict], dict]:
    """Per rows: every variant captured and replayed cold (L2 flushed); bytes / time."""
    timer: Callable[..., dict] = time_graph if device.type == "cuda" else time_eager
    rows_out, errors = [], {}
    fi = None if args.no_flashinfer or device.type != "cuda" else flashinfer_runner()
    if isinstance(fi, str):
        errors["flashinfer"], fi = fi, None
    for rows in args.rows:
        b = make_batch(args, rows, device, gen, kv, holes=args.holes, lens="full")
        valid = int((b.slots >= 0).sum())
        nbytes = valid * (args.latent + args.rope) * b.kv.element_size()
        nbytes += (
            b.q.numel() + b.q_rope.numel() + rows * args.heads * args.latent
        ) * b.q.element_size()
        flops = 2 * valid * args.heads * (2 * args.latent + args.rope)
        entry: dict[str, Any] = {"rows": rows, "valid": valid, "bytes": nbytes, "flops": flops}
        for k, cfg in enumerate(configs):
            splits = _splits(args, rows, cfg, sms)
            plan = new_split_plan(rows, splits, device)
            split_plan_torch(plan, b.lens, topk=args.topk, block_n=cfg.block_n)
            ws = new_workspace(rows, splits, args.heads, args.latent, device)
            out = torch.empty_like(b.q)
            name = "triton" if k == 0 else f"triton[{k}]"
            try:
                t = timer(lambda b=b, p=plan, w=ws, o=out, c=cfg: _run_triton(b, p, w, o, c), args)
            except Exception as e:  # a config that does not compile here: record, go on
                errors[f"{name} rows={rows}"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            t.update(config=vars(cfg) | {"splits": splits})
            entry[name] = t
        try:
            entry["torch"] = timer(
                lambda b=b: sparse_mla_decode(b.q, b.q_rope, b.kv, b.slots, b.scale), args
            )
        except torch.OutOfMemoryError as e:
            errors[f"torch rows={rows}"] = str(e)[:200]
        if fi is not None:
            try:
                run, err = fi(b)
                entry["flashinfer"] = timer(run, args) | {"rel_err": err}
            except Exception as e:
                errors[f"flashinfer rows={rows}"] = f"{type(e).__name__}: {str(e)[:300]}"
        for t in entry.values():
            if isinstance(t, dict) and "median_us" in t:
                t["tb_s"] = nbytes / (t["median_us"] * 1e-6) / 1e12
                t["copy_fraction"] = t["tb_s"] / copy_tbs if copy_tbs else None
                t["tflop_s"] = flops / (t["median_us"] * 1e-6) / 1e12
        rows_out.append(entry)
    return rows_out, errors


def render(result: dict) -> None:
    ceil = result["ceilings"]
    variants = sorted({k for r in result["timing"] for k in r if isinstance(r[k], dict)})
    table = []
    for r in result["timing"]:
        for v in variants:
            if v in r:
                t = r[v]
                splits = t.get("config", {}).get("splits", "")
                table.append(
                    [r["rows"], v, splits, t["median_us"], t["p99_us"], t["tb_s"], t["tflop_s"]]
                )
    print_table(
        f"sparse MLA decode, cold L2 (copy {ceil['copy_tb_s']:.2f} TB/s, bf16 mm {ceil['mm_tflop_s']:.0f} TFLOP/s)",
        ["rows", "variant", "splits", "median us", "p99 us", "TB/s", "TFLOP/s"],
        table,
    )
    acc = result["accuracy"]
    print(
        f"accuracy: {acc['batches']} batches, max rel err {acc['max_rel_err']:.2e}, "
        f"median {acc['median_rel_err']:.2e}, worst row {acc['max_row_rel_err']:.2e} "
        f"(tol {acc['tol']:.0e}); plan mismatches {result['plans']['mismatches']}; "
        f"replay {result['replay']}; errors {list(result['errors'])}; ok={result['ok']}",
        flush=True,
    )


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The comparison's results (``ok``: every check passed)."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    gen = torch.Generator().manual_seed(args.seed)
    sms = num_sms_of(device, cpu=8)
    configs = _configs(args)
    copy_tbs = copy_bandwidth(device)
    kv = make_kv(args, device, gen)
    result: dict[str, Any] = {
        "args": vars(args),
        "machine": machine(),
        "ceilings": {"copy_tb_s": copy_tbs, "mm_tflop_s": matmul_tflops(device)},
        "plans": check_plans(args, device, gen),
        "replay": check_replay(args, device, gen, kv, configs[0], sms),
        "accuracy": accuracy(args, device, gen, kv, configs[0], sms),
    }
    result["timing"], result["errors"] = timing(args, device, gen, kv, configs, sms, copy_tbs)
    result["ok"] = (
        not result["accuracy"]["failures"]
        and result["plans"]["mismatches"] == 0
        and result["replay"].get("mismatches", 0) == 0
    )
    render(result)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "bench_sparse_mla.json"), result)
    if args.plot:
        groups = [f"B={r['rows']}" for r in result["timing"]]
        names = ("triton", "torch", "flashinfer")
        series = {
            n: [r[n]["median_us"] if n in r else 0.0 for r in result["timing"]] for n in names
        }
        plot_bars(args.plot, "sparse MLA decode (cold L2)", groups, series, "median us")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
