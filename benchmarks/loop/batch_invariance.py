#!/usr/bin/env python3
"""The batch-invariant mode's claims, measured in one call: tokens, logits, prefill, speed.

On the H200 (``source scripts/device_prelude.sh`` first)::

    python3 -m benchmarks batch_invariance --out "$OUT" --plot "$OUT/batch_invariance.png"

Parts (``--parts``, all by default), each over dsv32-small in bf16 unless said:

- ``spec``: the 128-request speculative workload (``dsv32-small-spec``) served plainly and
  with n-gram and MTP drafts at 2, 4 and 8 draft tokens, with ``planner.batch_invariant``;
  how many requests' tokens equal plain greedy's (the claim: all of them). ``--default-too``
  serves the same runs in the default mode beside them (reported, not required);
- ``logits``: one request's logits alone and inside batches with 8, 64 and 128 other
  requests, at a seeded position, in decode and in verify (4 rows), through the graph
  runner as serving runs it (padded to the capture sizes): bit-identical, or not;
- ``chunks``: one 4,096-token prompt prefilled in chunks of 64, 256 and 2,048 tokens
  against the whole prompt at once: its last token's logits bit-identical, or not;
- ``speed``: the decode step (graph replay, synchronised) of the default and the invariant
  mode side by side, interleaved call by call, at B 1-64 on dsv32-small and dsv32-shapes:
  medians, p99 and the invariant/default ratio (the claim: at most 1.35x).

The invariant claims are checked in the invariant mode and reported for the default mode
too (the default mode is not expected to hold them). Writes ``batch_invariance.json``
under ``--out``; exit status 1 when a claim of the invariant mode fails. ``--smoke`` runs
every part on the CPU with the tiny preset and a few requests (its test: the float32 CPU
model is invariant in both modes, so every claim must hold there).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import logits_of, machine, plot_bars, print_table, time_paired
from benchmarks.kernels.profile_step import print_side_by_side, profile_steps
from dsv32_engine import SHIPPED_CONFIGS
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.model_setup import build_model, model_config, resolve_device
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.run_config import RunConfig, load_run_config
from planner.batch import ForwardMode

GPU_STEPS = {
    "": "--parts spec,logits,chunks --out {out}",
    "speed": "--parts speed --out {out}/speed --plot {out}/batch_invariance_speed.png",
}

PARTS = ("spec", "logits", "chunks", "speed")
INVARIANT = {"planner.batch_invariant": True}
DEFAULT = {"planner.batch_invariant": False}


class Setting:
    """The workload sizes of one run: the H200's, or the CPU smoke's."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.spec_config = SHIPPED_CONFIGS / "dsv32-small-spec.yaml"
        self.speed_configs = [
            SHIPPED_CONFIGS / f"dsv32-{name}.yaml" for name in ("small", "shapes")
        ]
        self.draft_tokens = (2, 4, 8)
        self.others = (8, 64, 128)
        self.prompt = 4096
        self.chunks = (64, 256, 2048)
        self.batches = (1, 2, 4, 8, 16, 32, 64)
        self.context = 1024
        self.base: dict[str, Any] = {}
        if smoke:
            tiny = {"device": "cpu", "model.preset": "tiny", "model.dtype": "float32"}
            tiny |= {"planner.max_context": 256, "loop.chunk_tokens": 64}  # small warm-ups
            self.base = tiny
            self.spec_base = {"loop.requests": 4, "loop.prompt_len": [4, 16]}
            self.spec_base |= {"loop.max_new_tokens": [4, 10], "planner.max_batch": 4}
            self.speed_configs = self.speed_configs[:1]
            self.draft_tokens, self.others, self.prompt = (2, 4), (2, 8), 40
            self.chunks, self.batches, self.context = (4, 16), (1, 2, 4), 24
        else:
            self.spec_base = {}


def _config(path: Path, *overrides: dict[str, Any]) -> RunConfig:
    merged: dict[str, Any] = {}
    for each in overrides:
        merged |= each
    return load_run_config(path, {**merged, "speculative.compare_plain": False})


def _free(device: torch.device) -> None:
    gc.collect()  # the last engine's graphs, pools and KV cache go before the next's
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- spec: speculative greedy tokens against plain greedy ------------------------------


def part_spec(s: Setting, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    first = _config(s.spec_config, s.base, s.spec_base)
    device = resolve_device(first.device)
    model = build_model(first, model_config(first.model), device)
    out: dict[str, Any] = {}
    for mode_name, mode in modes.items():
        plain = _tokens(_config(s.spec_config, s.base, s.spec_base, mode, _draft("none")), model)
        rows = {}
        for draft in ("ngram", "mtp"):
            for n in s.draft_tokens:
                config = _config(s.spec_config, s.base, s.spec_base, mode, _draft(draft, n))
                tokens = _tokens(config, model)
                same = sum(tokens.get(rid) == want for rid, want in plain.items())
                rows[f"{draft} x{n}"] = {"equal": same, "requests": len(plain)}
                print(f"spec {mode_name} {draft} x{n}: {same}/{len(plain)}", flush=True)
                _free(device)
        out[mode_name] = rows
    return out


def _draft(draft: str, n: int = 4) -> dict[str, Any]:
    if draft == "none":
        return {"speculative.draft": "none"}
    return {"speculative.draft": draft, "speculative.draft_tokens": n, "speculative.steps": n - 1}


def _tokens(config: RunConfig, model) -> dict[int, list[int]]:
    engine = DecodeEngine(config, model=model, keep_logits=True)
    return engine.run(progress=False, keep_tokens=True).tokens


# ---- logits and chunks: one request's logits against the same request elsewhere ----------


def _engine(config: RunConfig, model) -> DecodeEngine:
    engine = DecodeEngine(config, model=model, keep_logits=True)
    engine.warm_up()
    return engine


def _admit(engine: DecodeEngine, prompts: list[list[int]]) -> list[Request]:
    requests = [
        Request(rid=i, prompt=p, max_new_tokens=8, arrival_step=0) for i, p in enumerate(prompts)
    ]
    engine.scheduler.arrive(requests)
    engine.scheduler.admit(engine.limits.next_n)
    if len(engine.scheduler.running) < len(requests):
        raise RuntimeError("the KV cache or max_batch cannot hold the measured requests")
    return requests


def _feed(engine: DecodeEngine, request: Request, n: int) -> torch.Tensor:
    """Prefill ``n`` more prompt tokens of ``request`` (one extend batch); the logits after
    them (a copy)."""
    batch, ids = engine.scheduler.build_extend([(request, n)], ForwardMode.EXTEND)
    logits = logits_of(engine.runner.step(batch, {"input_ids": ids}))
    request.fed += n
    if not request.prefilling and not request.generated:
        request.take(int(logits[-1].argmax()), 0.0)
    return logits[-1].clone()


def _prefill(engine: DecodeEngine, request: Request, chunk: int) -> torch.Tensor:
    logits = None
    while request.prefilling:
        logits = _feed(engine, request, min(chunk, len(request.prompt) - request.fed))
    return logits


def part_logits(s: Setting, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rng = random.Random(0)
    total = 1 + max(s.others)
    spec = {"speculative.draft": "ngram", "speculative.draft_tokens": 4}
    sizes = {"planner.max_batch": total, "loop.requests": total}
    out: dict[str, Any] = {}
    for mode_name, mode in modes.items():
        config = _config(s.spec_config, s.base, s.spec_base, sizes, spec, mode)
        device = resolve_device(config.device)
        model = build_model(config, model_config(config.model), device)
        engine = _engine(config, model)
        vocab, n = model.config.vocab_size, engine.limits.next_n
        lo, hi = (8, 24) if s.smoke else (256, 1024)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(total)]
        requests = _admit(engine, prompts)
        for request in requests:
            _prefill(engine, request, config.loop.chunk_tokens)
        drafts = [[rng.randrange(vocab) for _ in range(n - 1)] for _ in requests]
        target, others = requests[0], requests[1:]
        rows = {}
        for kind, mode_of, per in (
            ("decode", ForwardMode.DECODE, 1),
            ("verify", ForwardMode.TARGET_VERIFY, n),
        ):
            alone = _rows(engine, [target], mode_of, per, drafts, 0)
            for count in s.others:
                batch = others[:count]
                at = rng.randint(0, count)
                batch = batch[:at] + [target] + batch[at:]
                mine = _rows(engine, batch, mode_of, per, drafts, at)
                rows[f"{kind} in {count + 1}"] = _compare(f"logits {mode_name}", alone, mine)
        out[mode_name] = rows
        del engine, model
        _free(device)
    return out


def _compare(what: str, want: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    """Whether ``got`` has ``want``'s bits, and how far it is off; printed as it goes."""
    same = torch.equal(want, got)
    diff = (want.float() - got.float()).abs().max().item()
    print(f"{what}: {same} ({diff:.3g})", flush=True)
    return {"bit_identical": same, "max_abs_diff": diff}


def _rows(
    engine: DecodeEngine, requests: list[Request], mode: ForwardMode, per: int, drafts, at: int
) -> torch.Tensor:
    """The logits rows of ``requests[at]`` in one decode or verify step of ``requests``."""
    batch_drafts = [drafts[r.rid] for r in requests] if per > 1 else None
    batch, ids = engine.scheduler.build(requests, mode, per, batch_drafts)
    logits = logits_of(engine.runner.step(batch, {"input_ids": ids}))
    return logits[at * per : (at + 1) * per].clone()


def part_chunks(s: Setting, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rng = random.Random(1)
    room = {
        "loop.chunk_tokens": s.prompt,
        "planner.max_context": s.prompt + 64,
        "planner.max_batch": len(s.chunks) + 1,
        "speculative.draft": "none",
    }
    out: dict[str, Any] = {}
    for mode_name, mode in modes.items():
        config = _config(s.spec_config, s.base, s.spec_base, room, mode)
        device = resolve_device(config.device)
        model = build_model(config, model_config(config.model), device)
        engine = _engine(config, model)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(s.prompt)]
        requests = _admit(engine, [list(prompt) for _ in range(len(s.chunks) + 1)])
        whole = _prefill(engine, requests[0], s.prompt)
        rows = {}
        for chunk, request in zip(s.chunks, requests[1:]):
            logits = _prefill(engine, request, chunk)
            rows[f"chunks of {chunk}"] = _compare(f"chunks {mode_name}", whole, logits)
        out[mode_name] = rows
        del engine, model
        _free(device)
    return out


# ---- speed: the decode step of both modes side by side --------------------------------


def part_speed(s: Setting, iters: int, profile: int = 0) -> dict[str, Any]:
    rng = random.Random(2)
    out: dict[str, Any] = {}
    for path in s.speed_configs:
        sizes = {"planner.max_batch": max(s.batches), "speculative.draft": "none"}
        room = {"planner.max_context": max(s.context + 64, 512)}
        first = _config(path, s.base, sizes, room)
        device = resolve_device(first.device)
        model = build_model(first, model_config(first.model), device)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(s.context)] for _ in range(max(s.batches))]
        steps: dict[str, Callable[[int], Any]] = {}
        engines: dict[str, tuple[DecodeEngine, list[Request]]] = {}
        for mode_name, mode in (("default", DEFAULT), ("invariant", INVARIANT)):
            # one model, two engines: each captures its graphs with its own mode's kernels
            engine = _engine(_config(path, s.base, sizes, room, mode), model)
            requests = _admit(engine, prompts)
            for request in requests:
                _prefill(engine, request, engine.config.loop.chunk_tokens)
            engines[mode_name] = (engine, requests)
        rows = {}
        for bs in s.batches:
            for mode_name, (engine, requests) in engines.items():
                steps[mode_name] = _decode_step(engine, requests[:bs], device)
            timed = time_paired(steps, warmup=5, iters=iters)
            rows[str(bs)] = {
                "default_ms": timed["default"]["median_us"] / 1e3,
                "invariant_ms": timed["invariant"]["median_us"] / 1e3,
                "default_p99_ms": timed["default"]["p99_us"] / 1e3,
                "invariant_p99_ms": timed["invariant"]["p99_us"] / 1e3,
                "ratio": timed["invariant"]["ratio_to_first"],
            }
            if profile and bs in (min(s.batches), max(s.batches)):
                rows[str(bs)]["profile"] = _profile(steps, profile, device)
                print_side_by_side(
                    f"kernels of a decode step, {first.model.preset} B {bs}",
                    rows[str(bs)]["profile"],
                )
        out[first.model.preset] = rows
        del engines, model
        _free(device)
    return out


def _profile(steps: dict[str, Callable[[int], Any]], n: int, device) -> dict[str, Any]:
    """Each mode's decode step, ``n`` steps under the profiler: device time by kernel group."""
    return {name: profile_steps(step, n, device, top=12)[0] for name, step in steps.items()}


def _decode_step(engine: DecodeEngine, requests: list[Request], device: torch.device):
    batch, ids = engine.scheduler.build(requests, ForwardMode.DECODE, 1)

    def step(_: int) -> None:
        engine.runner.step(batch, {"input_ids": ids})
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


# ---- the report ----------------------------------------------------------------------------


def failures(report: dict[str, Any], limit: float) -> list[str]:
    """The invariant mode's claims that did not hold, by name."""
    bad = []
    for name, row in report.get("spec", {}).get("invariant", {}).items():
        if row["equal"] != row["requests"]:
            bad.append(f"spec {name}: {row['equal']}/{row['requests']}")
    for part in ("logits", "chunks"):
        for name, row in report.get(part, {}).get("invariant", {}).items():
            if not row["bit_identical"]:
                bad.append(f"{part} {name}")
    for preset, rows in report.get("speed", {}).items():
        for bs, row in rows.items():
            if row["ratio"] > limit:
                bad.append(f"speed {preset} B{bs}: {row['ratio']:.2f}x")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--default-too", action="store_true", help="spec: the default mode too")
    p.add_argument("--iters", type=int, default=50, help="speed: timed steps per size")
    p.add_argument("--limit", type=float, default=1.35, help="speed: the allowed ratio")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="speed: also profile STEPS decode steps of each mode at the smallest and largest "
        "batch (kernels by group, side by side)",
    )
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    p.add_argument("--plot", type=str, default=None, help="PNG of the speed part")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, few requests")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown} (expected some of {PARTS})")
    s = Setting(args.smoke)
    both = {"invariant": INVARIANT, "default": DEFAULT}
    report: dict[str, Any] = {"machine": machine(), "smoke": args.smoke}
    runs = {
        "spec": lambda: part_spec(s, both if args.default_too else {"invariant": INVARIANT}),
        "logits": lambda: part_logits(s, both),
        "chunks": lambda: part_chunks(s, both),
        "speed": lambda: part_speed(s, 5 if args.smoke else args.iters, args.profile),
    }
    for part in PARTS:
        if part in parts:
            report[part] = runs[part]()
            _write(args.out, report)  # each part kept as it ends: a long run may be cut off
    if "speed" in parts:
        for preset, rows in report["speed"].items():
            table = [[bs, r["default_ms"], r["invariant_ms"], r["ratio"]] for bs, r in rows.items()]
            print_table(
                f"decode step, {preset}", ["B", "default ms", "invariant ms", "ratio"], table
            )
            plot_bars(
                args.plot and args.plot.replace(".png", f"_{preset}.png"),
                f"decode step, {preset}: invariant / default",
                [f"B{bs}" for bs in rows],
                {
                    "default": [r["default_ms"] for r in rows.values()],
                    "invariant": [r["invariant_ms"] for r in rows.values()],
                },
                "ms (median)",
            )
    report["failures"] = failures(report, args.limit)
    print("invariant mode:", "every claim holds" if not report["failures"] else report["failures"])
    _write(args.out, report)
    return 1 if report["failures"] else 0


def _write(out: Path | None, report: dict[str, Any]) -> None:
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "batch_invariance.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
