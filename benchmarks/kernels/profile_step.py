#!/usr/bin/env python3
"""Where a DeepSeek-V3.2 decode step's GPU time goes: kernels of one graph replay, by group.

The model-floor benchmark says how far the step is from its HBM floor; this says which
kernels the gap is in. For each (batch, context) the dsv32-shapes stack of
``benchmarks.kernels.model_floor`` (production kernels, one captured graph) replays under
torch.profiler with CUDA activity; the device time of every kernel is summed per step
and put in a group by its name (GEMMs, sparse MLA, indexer logits, top-k, the
planner's metadata, elementwise and norms, copies). A table per configuration prints
the groups and the top kernels; ``--out`` keeps everything as JSON, ``--plot`` draws
the groups as stacked bars.

    python3 -m benchmarks profile_step --out $OUT/profile_step.json --plot $OUT/profile_step.png
"""

from __future__ import annotations

import argparse
import random
import re
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.common import machine, print_table, sync, write_json
from benchmarks.kernels.model_floor import KERNELS, graph_runner
from benchmarks.kernels.seed_stack import make_batch, model_stack
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model

GPU_STEPS = {
    "": "--batches 1 64 --out {out}/profile_step.json --plot {out}/profile_step.png",
}

GROUPS = (
    ("sparse_mla", ("_attend", "_combine", "sparse_mla", "mla_decode", "mla_", "mla::")),
    ("indexer_logits", ("mqa_logits", "paged_mqa", "fp8_paged", "index_score", "logits")),
    ("topk", ("topk", "top_k", "radix", "sort", "select")),
    ("metadata", ("schedule", "kv_gather", "cumsum", "page_table", "causal", "gather_token")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "nvjet", "matmul", "splitk")),
    ("norm_rope_act", ("norm", "rope", "rotary", "silu", "act_and_mul", "softmax")),
    ("copy_fill", ("copy", "memcpy", "memset", "fill", "cat", "index", "scatter")),
)
"""Kernel name substrings per group, tried in order (the first group that matches wins)."""


_MODULE = "module::"
"""Prefix of the profiler ranges ``--sites`` wraps modules in."""


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(key in lowered for key in keys):
            return group
    return "elementwise_other"


def kernel_times(prof: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Device microseconds per step of each kernel name (CUDA events only)."""
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name.startswith(_MODULE):
            continue  # a module's range (``--sites``), not a kernel
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total:
            per_name[event.name] += event.device_time_total / steps
    return dict(per_name)


def profile_config(model, batch: int, ctx: int, kernel: str, phase: str, args, device) -> dict:
    setup = model_stack(args, batch, ctx, device, model)
    table = setup[0]
    runner = graph_runner(model, setup, kernel, batch, ctx, device)
    rng = random.Random(args.seed)
    batches = [make_batch(table, batch, ctx, rng) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.capture()
        eager = "profiled eagerly" if phase == "eager" else None
        stacks = phase == "eager" and args.sites
        # Labels on before the warm-up, so their first use (torch's profiler ops load
        # lazily) runs outside the profile. The Python tracer keeps frame names as
        # pointers into code objects; with the labels first used inside the profile, about
        # 1 CPU run in 4 failed to parse (a freed name, pytorch/pytorch#64345), 0 of 16
        # since.
        hooks = label_modules(model) if stacks else []
        for i in range(args.warmup):
            runner.step(batches[i % len(batches)], eager=eager)
        profiled, prof = profile_steps(
            lambda i: runner.step(batches[i % len(batches)], eager=eager),
            args.steps,
            device,
            top=args.top,
            torch_ops=phase == "eager",
            with_stack=stacks,
        )
        for hook in hooks:
            hook.remove()
    replays = runner.stats.graph_steps
    runner.close()
    sites = call_sites(prof, args.steps, args.top, device=device.type == "cuda") if stacks else []
    return {
        "batch": batch,
        "ctx": ctx,
        "kernel": kernel,
        "phase": phase,
        "graph_replays": replays,
        **profiled,
        "call_sites": sites,
    }


def profile_steps(
    step: Callable[[int], object],
    steps: int,
    device: torch.device,
    *,
    top: int = 15,
    torch_ops: bool = False,
    with_stack: bool = False,
) -> tuple[dict, torch.profiler.profile]:
    """Device time of ``step(i)`` for ``i < steps`` under torch.profiler, per step: the
    total, by kernel group, the ``top`` kernels and (``torch_ops``) the aten ops that
    launched them; and the profiler, for more queries. Kernels inside a replayed CUDA
    graph are counted like any other. The caller warms up first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities, with_stack=with_stack) as prof:
        for i in range(steps):
            step(i)
        sync(device)
    kernels = kernel_times(prof, steps)
    groups: dict[str, float] = defaultdict(float)
    for name, us in kernels.items():
        groups[group_of(name)] += us
    ops = []
    if torch_ops and device.type == "cuda":  # which torch ops launch them, with counts
        for op in prof.key_averages():
            if op.key.startswith("aten::") and op.self_device_time_total:
                ops.append((op.key, op.self_device_time_total / steps, op.count / steps))
        ops.sort(key=lambda row: -row[1])
    return {
        "device_us_per_step": sum(kernels.values()),
        "groups_us": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top_kernels_us": sorted(kernels.items(), key=lambda kv: -kv[1])[:top],
        "torch_ops": ops[: 2 * top],
    }, prof


_REPO_DIRS = ("dsv32_engine/models/", "backends/", "planner/", "graphs/")


def label_modules(model: torch.nn.Module) -> list:
    """Wrap every submodule's forward in a profiler range named after it (layer indices
    folded: ``layers.*.attn.wq_a``), so kernels are attributed to the module that ran
    them even where the profiler records no Python frames (it did not on the H200's torch)."""
    hooks = []
    for name, module in model.named_modules():
        if not name or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        label = _MODULE + re.sub(r"\.\d+\.", ".*.", name)
        ranges: list = []

        def enter(mod, inputs, label=label, ranges=ranges):
            ranges.append(torch.autograd.profiler.record_function(label))
            ranges[-1].__enter__()

        def leave(mod, inputs, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return hooks


def _repo_frame(event) -> str | None:
    """Where ``event`` was issued: the innermost labelled module above it, with the
    innermost Python frame of this repository's code (``path(line): function``) when the
    profiler recorded frames."""
    parent, frame = event.cpu_parent, None
    while parent is not None:
        name = parent.name
        if name.startswith(_MODULE):
            module = name[len(_MODULE) :]
            return module if frame is None else f"{module} @ {frame}"
        for root in _REPO_DIRS:
            at = name.find(root)
            if frame is None and at >= 0 and "(" in name[at:]:
                frame = name[at:]
        parent = parent.cpu_parent
    return frame


def call_sites(prof: torch.profiler.profile, steps: int, top: int, *, device: bool) -> list[tuple]:
    """Time of the outermost torch ops per calling source line: where the small kernels
    come from.

    The op table says which aten ops launch kernels; this says which line of the model
    or a backend issued them (the innermost frame under the repository's packages), so
    a fusion can be aimed at the line that pays most. Without a GPU (``device=False``)
    the ops' CPU time stands in, so the attribution itself runs in the CPU suite.
    """
    per_site: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (
            parent is not None and parent.name.startswith("aten::")
        ):
            continue  # only the op a Python line called, its nested ops counted inside it
        spent = event.device_time_total if device else event.cpu_time_total
        if not spent:
            continue
        cell = per_site[(_repo_frame(event) or "(outside the repository)", event.name)]
        cell[0] += spent / steps
        cell[1] += 1 / steps
    rows = [(site, op, us, calls) for (site, op), (us, calls) in per_site.items()]
    rows.sort(key=lambda row: -row[2])
    return rows[: 3 * top]


def print_groups(title: str, profiled: dict) -> str:
    """Print (and return) a profile's kernel groups and top kernels, per step."""
    total = profiled["device_us_per_step"] or float("nan")
    rows = [(g, us, 100 * us / total) for g, us in profiled["groups_us"].items()]
    text = print_table(title, ("group", "us/step", "%"), rows)
    tops = [(name[:90], us, 100 * us / total) for name, us in profiled["top_kernels_us"]]
    return text + "\n" + print_table("top kernels", ("kernel", "us/step", "%"), tops)


def print_side_by_side(title: str, profiled: dict[str, dict]) -> str:
    """Print (and return) several profiles' kernel groups as columns (us per step), then
    the top kernels of each: where one variant's step spends what another's does not."""
    names = list(profiled)
    groups = sorted({g for p in profiled.values() for g in p["groups_us"]})
    rows = [(g, *(profiled[n]["groups_us"].get(g, 0.0) for n in names)) for g in groups]
    rows.append(("total", *(profiled[n]["device_us_per_step"] for n in names)))
    text = print_table(title, ("group", *(f"{n} us" for n in names)), rows)
    for n in names:
        tops = [(k[:90], us) for k, us in profiled[n]["top_kernels_us"]]
        text += "\n" + print_table(f"top kernels, {n}", ("kernel", "us/step"), tops)
    return text


def report(row: dict) -> str:
    total = row["device_us_per_step"] or float("nan")
    title = (
        f"B {row['batch']} ctx {row['ctx']} ({row['kernel']}, {row['phase']}): "
        f"{total:.0f} us of kernels per step, {row['graph_replays']} graph replays"
    )
    text = print_groups(title, row)
    if row["torch_ops"]:
        ops = [(name, us, calls) for name, us, calls in row["torch_ops"]]
        text += "\n" + print_table(
            "torch ops (self device time)", ("op", "us/step", "calls/step"), ops
        )
    if row.get("call_sites"):
        sites = [(site[:100], op, us, calls) for site, op, us, calls in row["call_sites"]]
        text += "\n" + print_table(
            "call sites (self time)", ("site", "op", "us/step", "calls/step"), sites
        )
    return text


def plot(path: str | None, rows: list[dict]) -> None:
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({g for r in rows for g in r["groups_us"]})
    labels = [f"B{r['batch']} {r['ctx'] // 1024}k {r['phase']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 4))
    bottom = [0.0] * len(rows)
    for name in names:
        values = [r["groups_us"].get(name, 0.0) / 1e3 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("kernel ms per step")
    ax.set_title("dsv32 decode step: device time by kernel group")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="per-kernel device time of a dsv32 decode step")
    p.add_argument("--preset", default="shapes", help="model preset (tiny for a CPU smoke test)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096])
    p.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), default=["production"])
    p.add_argument(
        "--phases",
        nargs="+",
        choices=("graph", "eager"),
        default=["graph", "eager"],
        help="graph replays (kernels inside a graph need a CUPTI that traces them) and eager steps",
    )
    p.add_argument(
        "--sites",
        action="store_true",
        help="eager phase: attribute torch ops' device time to the source lines that issued them",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="profiled graph steps per configuration")
    p.add_argument("--top", type=int, default=15, help="kernels listed per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG of the groups per configuration")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = DSV32Model(DSV32Config.preset(args.preset), seed=args.seed, device=device, dtype=dtype)
    rows, texts = [], []
    for ctx in args.contexts:
        for batch in args.batches:
            for name in args.kernels:
                for phase in args.phases:
                    row = profile_config(model, batch, ctx, KERNELS[name], phase, args, device)
                    rows.append(row)
                    texts.append(report(row))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows, "tables": texts})
    plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
