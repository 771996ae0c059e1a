"""``python -m planner decode``: DeepSeek-V3.2 decode through the planner loop."""

from __future__ import annotations

import argparse
import json
from typing import Any

from planner.errors import ConfigError
from serving.cli import DEFAULT_DECODE_CONFIG
from serving.engine import DecodeEngine, DumpSettings, RunResult
from serving.report import render, summarize
from serving.run_config import RunConfig, load_run_config


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
    if args.no_graphs:
        out["graphs.enabled"] = False
    if args.debug:
        out["planner.debug"] = True
    if args.load_weights:
        out["model.weights"] = str(args.load_weights)
    providers = {}
    for item in args.provider:
        op, sep, name = item.partition("=")
        if not sep:
            raise ConfigError("expected OP=PROVIDER", field="--provider", actual=item)
        providers[op] = name
    if providers:
        out["planner.providers"] = providers
    return out


def run(args: argparse.Namespace) -> int:
    """Build the engine from the config and flags, serve the workload, print the summary."""
    path = args.config or (DEFAULT_DECODE_CONFIG if DEFAULT_DECODE_CONFIG.is_file() else None)
    config = load_run_config(path, _overrides(args))
    dumps = (
        DumpSettings(args.dump_dir, every=args.dump_every, keep=args.dump_keep)
        if args.dump_dir
        else None
    )
    engine = DecodeEngine(config, dumps=dumps)
    if args.save_weights:
        engine.model.save(args.save_weights)
    result = engine.run(progress=not args.quiet, max_steps=args.max_steps)
    summary = summarize(engine, result)
    if config.speculative.enabled and config.speculative.compare_plain:
        summary["plain"] = plain_baseline(config, engine, result, args)
    render(summary)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "tokens": result.tokens}, indent=2))
    return 0


def plain_baseline(
    config: RunConfig, engine: DecodeEngine, result: RunResult, args: argparse.Namespace
) -> dict[str, Any]:
    """The same workload and model without speculation: its throughput, and whether greedy
    speculative decoding emitted exactly its tokens."""
    plain_config = config.model_copy(
        update={"speculative": config.speculative.model_copy(update={"draft": "none"})}
    )
    plain_engine = DecodeEngine(plain_config, model=engine.model)
    plain = plain_engine.run(progress=not args.quiet, max_steps=args.max_steps)
    summary = summarize(plain_engine, plain)
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "decode_tokens_per_second": summary["decode_tokens_per_second"],
        "decode_steps": summary["decode_steps"],
        "tokens_equal": plain.tokens == result.tokens,
    }
