#!/usr/bin/env python3
"""GPU soak: real CUDA graphs replay == eager over random batch sequences, and a long decode run.

Part A (``fuzz``): ``--sequences`` (1,000) random batch sequences through graph runners over
one planner of both the NSA (DeepSeek-V3.2) and the paged backend, each runner with a
random capture-size set, decode and target-verify. The captured forward reads every plan
field (an integer digest per row), so the planner's graph-safe ops are recorded in the
graph and run by ``graph.replay()``. After each replayed step the plans must be the
captured objects at their captured addresses, equal ``plan(batch, pad_to=size)`` bit for
bit, hold the pad values in padding rows, and the graph's digest must equal the digest of
the padded eager plan.

Part B (``decode``): at least ``--decode-steps`` (2,000) decode steps of dsv32-small through
``planner/serving/engine.py`` (CUDA graphs, deep_gemm when installed) with requests
arriving and finishing. After a warm-up it samples ``torch.cuda.memory_allocated`` /
``memory_reserved`` and host RSS; at the end every KV page is returned, no batch ran
eagerly, no capture was dropped.

Prints a table; ``--out`` writes JSON. Exit status 1 when a check fails. On the H200
(about 2-3 minutes)::

    source scripts/device_prelude.sh || exit 1
    python3 benchmarks/soak_gpu.py --out "$OUT/soak_gpu.json"

``--device cpu --config dsv32-tiny.yaml`` runs the same code on emulated graphs (a smoke
test with small ``--sequences`` / ``--decode-steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.soak_decode import part_decode  # noqa: E402
from benchmarks.soak_fuzz import part_fuzz  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", nargs="+", choices=("fuzz", "decode"), default=["fuzz", "decode"])
    p.add_argument("--sequences", type=int, default=1000)
    p.add_argument("--runners", type=int, default=10, help="capture-size sets in part A")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="decode steps before memory sampling")
    p.add_argument("--every", type=int, default=100, help="decode steps between samples")
    p.add_argument("--config", default="dsv32-small.yaml", help="run config for part B")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[2, 8], metavar=("LO", "HI"))
    p.add_argument("--max-new-tokens", type=int, nargs=2, default=[32, 160], metavar=("LO", "HI"))
    p.add_argument("--max-allocated-growth-mib", type=float, default=1.0)
    p.add_argument("--max-reserved-growth-mib", type=float, default=64.0)
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


# ---- output --------------------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    lines = [f"soak on {result['machine']['device_name']}"]
    fuzz = result.get("fuzz")
    if fuzz:
        lines += [
            "",
            "A. random batch sequences, replay == eager (nsa + paged)",
            f"  sequences {fuzz['sequences']} over {fuzz['runners']} capture-size sets, "
            f"{fuzz['graphs_captured']} graphs ({fuzz['captures_dropped']} dropped)",
            f"  replays {fuzz['replays']} (decode {fuzz['replays_decode']}, verify "
            f"{fuzz['replays_verify']}), eager {fuzz['eager_steps']}, sizes "
            f"{fuzz['distinct_sizes']}",
            f"  mismatches {fuzz['mismatches']}   {fuzz['seconds']:.1f} s   "
            f"{'PASS' if fuzz['ok'] else 'FAIL'}",
        ]
        lines += [f"  ! {f}" for f in fuzz["first_failures"]]
    dec = result.get("decode")
    if dec:
        lines += [
            "",
            f"B. decode soak ({dec['config']}, {dec['graph_kind']} graphs)",
            f"  {dec['decode_steps']} decode steps (+{dec['prefill_steps']} prefill), "
            f"{dec['requests']} requests, batch sizes seen {dec['batch_sizes']} "
            f"(largest {dec['largest_batch']}), {dec['wall_seconds']:.1f} s",
            f"  step p50 {dec['step_ms_p50']:.2f} ms, p99 {dec['step_ms_p99']:.2f} ms; graph "
            f"steps {dec['graph_steps']}, eager {dec['eager_fallbacks'] or 0}",
            f"  after warm-up: allocated {dec['allocated_mib_after_warmup']:.1f} MiB "
            f"(+{dec['allocated_growth_mib']:.2f}), reserved +{dec['reserved_growth_mib']:.2f} "
            f"MiB, RSS {dec['rss_mib_after_warmup']:.0f} MiB (+{dec['rss_growth_mib']:.2f})",
        ]
        for name, ok in dec["checks"].items():
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    start = time.perf_counter()
    if "fuzz" in args.parts:
        result["fuzz"] = part_fuzz(args, device)
    if "decode" in args.parts:
        result["decode"] = part_decode(args, device)
    result["seconds"] = time.perf_counter() - start
    result["ok"] = all(result[p]["ok"] for p in args.parts)
    print(render(result))
    print(f"\ntotal {result['seconds']:.1f} s: {'PASS' if result['ok'] else 'FAIL'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
