"""The ``moe`` section of benchmarks/bench_moe_topk.py: routed MoE against every-expert dense.

The routed ``MoE`` (auto provider and the Triton grouped GEMM) shares the dense
module's weights (a real-sized layer is 22 GB, so no copy), must match it within a
relative 1e-2 and replay under a CUDA graph as it runs eagerly; each variant's time
comes with the expert weight bytes it must read.
"""

from __future__ import annotations

import argparse
import traceback
from typing import Any

import torch

from benchmarks.graph_timers import time_eager, time_graph
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.ffn import DenseMoE, MoE
from dsv32_engine.models.layers.grouped_gemm import grouped_mm_provider


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius relative error in float64, so bf16 rounding is measured, not repeated."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def make_moe(cfg: DSV32Config, device: torch.device, dtype: torch.dtype) -> MoE:
    """Random weights at sensible scales (activations O(1)), allocated on the device."""
    with torch.device(device):
        moe = MoE(cfg, dtype)
    d = cfg.hidden_size
    with torch.no_grad():
        moe.gate.weight.normal_(0, d**-0.5)
        moe.gate.bias.normal_(0, 0.05)
        ins, outs = [moe.w1, moe.w3], [moe.w2]  # fan-in dim, fan-in inter
        if moe.shared is not None:
            ins += [moe.shared.w1.weight, moe.shared.w3.weight]
            outs.append(moe.shared.w2.weight)
        for p in ins:
            p.normal_(0, d**-0.5)
        for p in outs:
            p.normal_(0, p.shape[-1] ** -0.5)
    return moe


def expert_bytes(cfg: DSV32Config, experts: int, dtype: torch.dtype) -> int:
    per = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.finfo(dtype).bits // 8
    return experts * per


def _share(cls: type[MoE], cfg: DSV32Config, moe: MoE, **kw: Any) -> MoE:
    """A ``cls`` module over ``moe``'s tensors (no copy: a real layer is 22 GB)."""
    with torch.device("meta"):
        twin = cls(cfg, moe.w1.dtype, **kw)
    twin.load_state_dict(moe.state_dict(), assign=True)
    return twin


def moe_case(
    args: argparse.Namespace, name: str, cfg: DSV32Config, variants: dict[str, MoE], x: torch.Tensor
) -> tuple[dict[str, Any], list[str]]:
    """One (shape, rows) cell: errors against dense, replay check, times, bytes."""
    fails, rows = [], x.shape[0]
    timer = time_eager if x.device.type == "cpu" else time_graph
    pairs = torch.empty(rows * cfg.num_experts_per_tok, cfg.hidden_size, dtype=x.dtype)
    provider = grouped_mm_provider(pairs.to(x.device), variants["routed"].w1.transpose(1, 2))
    row: dict[str, Any] = {"shape": name, "rows": rows, "provider": provider}
    with torch.no_grad():
        want = variants["dense"](x)
        row["experts_used"] = chosen = variants["routed"].gate(x)[1].unique().numel()
        for label, module in variants.items():
            try:
                if label != "dense":
                    row[f"{label}_err"] = err = rel_err(module(x), want)
                    if not err < 1e-2:
                        fails.append(f"moe {name} rows={rows} {label}: rel err {err:.3g}")
                    if x.device.type == "cuda" and not replay_matches_eager(module, x):
                        fails.append(f"moe {name} rows={rows} {label}: replay differs from eager")
                t = timer(lambda m=module: m(x), warmup=args.warmup, iters=args.iters)
            except Exception as e:  # record and go on: one broken variant spoils no other
                fails.append(f"moe {name} rows={rows} {label}: {type(e).__name__}: {e}")
                row[f"{label}_error"] = traceback.format_exc(limit=3)
                continue
            gb = expert_bytes(cfg, cfg.n_routed_experts if label == "dense" else chosen, x.dtype)
            row[label] = {
                **t,
                "weights_GB": gb / 1e9,
                "TB_per_s": gb / 1e12 / (t["median_us"] * 1e-6),
            }
    return row, fails


def moe_section(args: argparse.Namespace, device: torch.device, fails: list[str]) -> list[dict]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    names = ["tiny"] if args.smoke else args.moe_shapes
    results = []
    for name in names:
        cfg = DSV32Config.preset(name)
        moe = make_moe(cfg, device, dtype)
        variants = {"dense": _share(DenseMoE, cfg, moe), "routed": moe}
        if device.type == "cuda":
            variants["routed_triton"] = _share(MoE, cfg, moe, grouped_mm_provider="triton")
        gen = torch.Generator(device=device).manual_seed(args.seed)
        for rows in args.rows:
            x = torch.randn(rows, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
            row, bad = moe_case(args, name, cfg, variants, x)
            results.append(row)
            fails += bad
        del moe, variants
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def replay_matches_eager(module: MoE, x: torch.Tensor) -> bool:
    """Capture on one input, replay on another: the replay must be that input's eager result."""
    static = x.clone()
    module(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(static)
    static.copy_(torch.randn_like(x))
    graph.replay()
    return torch.equal(y, module(static))
