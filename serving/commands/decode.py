"""``python -m planner decode``: DeepSeek-V3.2 decode through the planner loop."""

from __future__ import annotations

import argparse
import json
from typing import Any

from planner.errors import ConfigError
from serving.cli import DEFAULT_DECODE_CONFIG
from serving.engine import DecodeEngine, DumpSettings
from serving.report import render, summarize
from serving.run_config import load_run_config


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.device:
        out["device"] = args.device
    if args.requests is not None:
        out["loop.requests"] = args.requests
    if args.next_n is not None:
        out["planner.next_n"] = args.next_n
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
    render(summary)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "tokens": result.tokens}, indent=2))
    return 0
