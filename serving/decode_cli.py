"""``python -m planner decode``: DeepSeek-V3.2 decode through the planner loop."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dsv32-tiny.yaml"


def add_decode_parser(sub: Any) -> None:
    p = sub.add_parser(
        "decode",
        help="run DeepSeek-V3.2 decode through the planner loop (CPU tiny model by default)",
        description="Serve a synthetic workload with continuous batching: every decode step goes "
        "through the planner and the graph runner; a summary is printed at the end.",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"YAML run config (default: {DEFAULT_CONFIG.name})",
    )
    p.add_argument("--device", help="override the config's device (cpu, cuda)")
    p.add_argument("--requests", type=int, help="override loop.requests")
    p.add_argument("--max-steps", type=int, help="stop after this many loop steps")
    p.add_argument(
        "--next-n",
        type=int,
        choices=(1, 2),
        help="2: speculative target-verify with a trivial draft",
    )
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    p.add_argument(
        "--debug", action="store_true", help="verify every replayed plan against eager (slow)"
    )
    p.add_argument(
        "--provider",
        action="append",
        default=[],
        metavar="OP=NAME",
        help="force a provider for an op",
    )
    p.add_argument("--load-weights", type=Path, help="safetensors weights saved by --save-weights")
    p.add_argument(
        "--save-weights", type=Path, help="save the model's weights (safetensors) before running"
    )
    p.add_argument(
        "--dump-dir",
        type=Path,
        default=os.environ.get("PLANNER_DUMP_DIR"),
        help="write plan dumps here (PLANNER_DUMP_DIR)",
    )
    p.add_argument(
        "--dump-every",
        type=int,
        default=int(os.environ.get("PLANNER_DUMP_EVERY", "1")),
        help="dump every Nth decode step",
    )
    p.add_argument(
        "--dump-keep",
        type=int,
        default=int(os.environ.get("PLANNER_DUMP_KEEP", "8")),
        help="keep the last N step dumps",
    )
    p.add_argument("--json", type=Path, help="also write the summary (and tokens) as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_decode)


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
            from planner.errors import ConfigError

            raise ConfigError("expected OP=PROVIDER", field="--provider", actual=item)
        providers[op] = name
    if providers:
        out["planner.providers"] = providers
    return out


def run_decode(args: argparse.Namespace) -> int:
    from serving.engine import DecodeEngine
    from serving.report import render, summarize
    from serving.run_config import load_run_config

    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    config = load_run_config(path, _overrides(args))
    engine = DecodeEngine(config)
    if args.save_weights:
        engine.model.save(args.save_weights)
    if args.dump_dir:
        engine.enable_dumps(args.dump_dir, every=args.dump_every, keep=args.dump_keep)
    result = engine.run(progress=not args.quiet, max_steps=args.max_steps)
    summary = summarize(engine, result)
    render(summary)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "tokens": result.tokens}, indent=2))
    return 0
