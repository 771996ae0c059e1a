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
    python3 benchmarks/bench_sparse_mla.py --out "$OUT" --plot "$OUT/sparse_mla.png"

``--smoke`` runs tiny shapes on the CPU under the Triton interpreter (eager timing, no
graphs, no FlashInfer): a test runs it so the script cannot rot.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

if "--smoke" in sys.argv and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
from benchmarks.bench_sparse_mla_parts import (  # noqa: E402
    Batch,
    copy_bandwidth,
    flashinfer_runner,
    make_batch,
    make_kv,
    matmul_tflops,
    time_eager,
    time_graph,
)
from benchmarks.common import machine, num_sms_of, plot_bars, print_table, write_json  # noqa: E402


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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
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


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
