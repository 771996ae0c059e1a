"""``python -m planner decode``: DeepSeek-V3.2 decode through the planner loop.

Everything the run will write (``--json``, ``--save-weights``, the dump folder) and every
environment variable it reads is checked before the engine is built, so a run never
fails at its end and loses its results.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from dsv32_engine.distributed.group import launched_by_torchrun
from dsv32_engine.serving.cli import DEFAULT_DECODE_CONFIG
from dsv32_engine.serving.dump_ring import DEFAULT_KEEP, ENV_DIR, ENV_EVERY, ENV_KEEP
from dsv32_engine.serving.engine import DecodeEngine, DumpSettings, RunResult
from dsv32_engine.serving.launch import launch
from dsv32_engine.serving.outputs import check_output_file, env_count, env_path, new_run_dir
from dsv32_engine.serving.report import render, summarize
from dsv32_engine.serving.run_config import RunConfig, load_run_config
from planner.errors import ConfigError


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.device:
        out["device"] = args.device
    if args.requests is not None:
        out["loop.requests"] = args.requests
    if args.draft is not None:
        out["speculative.draft"] = args.draft
    if args.draft_tokens is not None:
        out["speculative.draft_tokens"] = args.draft_tokens
    if args.compare_plain:
        out["speculative.compare_plain"] = True
    if args.mla_kernel is not None:
        out["planner.mla_kernel"] = args.mla_kernel
    if args.staging is not None:
        out["planner.staging_in_graph"] = {"auto": "auto", "graph": True, "copy": False}[
            args.staging
        ]
    if args.no_graphs:
        out["graphs.enabled"] = False
    if args.debug:
        out["planner.debug"] = True
    if args.load_weights:
        out["model.weights"] = str(args.load_weights)
    flags = {
        "tp": "distributed.tp",
        "dp_attention": "distributed.dp_attention",
        "dist_backend": "distributed.backend",
        "dist_timeout": "distributed.timeout_s",
        "dp_split": "distributed.dp_split",
    }
    for name, key in flags.items():
        if getattr(args, name, None) is not None:
            out[key] = getattr(args, name)
    if getattr(args, "digests", False):
        out["distributed.digests"] = True
    providers = {}
    for item in args.provider:
        op, sep, name = item.partition("=")
        if not sep:
            raise ConfigError("expected OP=PROVIDER", field="--provider", actual=item)
        providers[op] = name
    if providers:
        out["planner.providers"] = providers
    return out


@dataclass(frozen=True)
class Outputs:
    """Where this run writes, every path checked; the dump folder already made."""

    json: Path | None
    weights: Path | None
    dumps: DumpSettings | None


def _dump_settings(args: argparse.Namespace, env: dict[str, str]) -> DumpSettings | None:
    """The flags first, then ``PLANNER_DUMP_*``; each value named by where it came from."""
    every = args.dump_every or env_count(env, ENV_EVERY, 1)
    keep = args.dump_keep or env_count(env, ENV_KEEP, DEFAULT_KEEP)
    base, field = args.dump_dir, "--dump-dir"
    if base is None:
        base, field = env_path(env, ENV_DIR), ENV_DIR
    if base is None:
        return None
    return DumpSettings(new_run_dir(base, field), every=every, keep=keep)


def check_outputs(args: argparse.Namespace, env: dict[str, str]) -> Outputs:
    """Check every path the run writes before it starts (the dump folder is made last)."""
    json_path = check_output_file(args.json, "--json") if args.json else None
    weights = check_output_file(args.save_weights, "--save-weights") if args.save_weights else None
    if json_path and weights and json_path.resolve() == weights.resolve():
        raise ConfigError("--json and --save-weights name one file", field="--json")
    return Outputs(json_path, weights, _dump_settings(args, env))


def _save_weights(engine: DecodeEngine, path: Path) -> None:
    try:
        engine.model.save(path)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(
            f"cannot save the weights to {path}: {exc}", field="--save-weights"
        ) from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Written next to ``path`` first, then renamed: a failed write leaves no half file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"cannot write {path} after the run (the summary is printed above): {exc}",
            field="--json",
        ) from None


def _dump_line(engine: DecodeEngine, directory: Path) -> str:
    ring = engine.dump_ring
    kept = len(ring.kept) if ring is not None else 0
    mismatches = directory / "mismatches"
    found = sum(1 for _ in mismatches.iterdir()) if mismatches.is_dir() else 0
    return (
        f"plan dumps: {directory} ({kept} step dumps, {found} mismatches); "
        f"list them with: python -m planner inspect {directory}"
    )


def run(args: argparse.Namespace) -> int:
    """Build the engine from the config and flags, serve the workload, print the summary."""
    config = load_run_config(args.config or DEFAULT_DECODE_CONFIG, _overrides(args))
    if config.distributed.world > 1 or launched_by_torchrun():
        return run_ranks(config, args)
    outputs = check_outputs(args, dict(os.environ))
    try:
        engine = DecodeEngine(config, dumps=outputs.dumps)
    except BaseException:
        if outputs.dumps is not None:
            outputs.dumps.directory.rmdir()  # made for this run, still empty
        raise
    if outputs.weights:
        _save_weights(engine, outputs.weights)
    compare = config.speculative.enabled and config.speculative.compare_plain
    result = engine.run(
        progress=not args.quiet,
        max_steps=args.max_steps,
        keep_tokens=outputs.json is not None or compare,
    )
    summary = summarize(engine, result)
    if compare:
        summary["plain"] = plain_baseline(config, engine, result, args)
    render(summary)
    if outputs.dumps is not None:
        summary["dump_dir"] = str(outputs.dumps.directory)
        print(_dump_line(engine, outputs.dumps.directory))
    if outputs.json:
        _write_json(outputs.json, {"summary": summary, "tokens": result.tokens})
    return 0


def run_ranks(config: RunConfig, args: argparse.Namespace) -> int:
    """Several ranks: only the flags that make sense there; per-rank and aggregate summaries."""
    for flag in ("save_weights", "dump_dir", "compare_plain"):
        if getattr(args, flag, None):
            raise ConfigError(
                "not supported with several ranks yet",
                field="--" + flag.replace("_", "-"),
                expected=f"a single-rank run (distributed world {config.distributed.world})",
            )
    json_path = check_output_file(args.json, "--json") if args.json else None
    options = {"max_steps": args.max_steps, "json": str(json_path) if json_path else None}
    return launch(config, options)


def plain_baseline(
    config: RunConfig, engine: DecodeEngine, result: RunResult, args: argparse.Namespace
) -> dict[str, Any]:
    """The same workload and model without speculation: its throughput, and whether greedy
    speculative decoding emitted exactly its tokens."""
    plain_config = config.model_copy(
        update={"speculative": config.speculative.model_copy(update={"draft": "none"})}
    )
    plain_engine = DecodeEngine(plain_config, model=engine.model)
    plain = plain_engine.run(progress=not args.quiet, max_steps=args.max_steps, keep_tokens=True)
    summary = summarize(plain_engine, plain)
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "decode_tokens_per_second": summary["decode_tokens_per_second"],
        "decode_steps": summary["decode_steps"],
        "tokens_equal": plain.tokens == result.tokens,
    }
