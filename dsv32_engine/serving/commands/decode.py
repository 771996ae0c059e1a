"""``python -m planner decode``: DeepSeek-V3.2 decode through the planner loop.

Everything the run will write (``--json``, ``--save-weights``, the dump folder) and every
environment variable it reads is checked before the engine is built, so a run never
fails at its end and loses its results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError

from dsv32_engine.distributed.group import launched_by_torchrun
from dsv32_engine.serving.busy import GpuBusy
from dsv32_engine.serving.cli import DEFAULT_DECODE_CONFIG, Interrupted
from dsv32_engine.serving.dump_ring import DEFAULT_KEEP, ENV_DIR, ENV_EVERY, ENV_KEEP, DumpSettings
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.launch import cpu_threads, launch
from dsv32_engine.serving.memory_fit import allocation_errors, check_memory
from dsv32_engine.serving.model_setup import resolve_device
from dsv32_engine.serving.outputs import check_output_file, env_count, env_path, new_run_dir
from dsv32_engine.serving.report import render, summarize
from dsv32_engine.serving.run_config import RunConfig, load_run_config
from dsv32_engine.serving.run_result import RunResult
from planner.debug import debug_from_env
from planner.errors import ConfigError

FLAGS = {
    "device": ("--device", "device"),
    "requests": ("--requests", "loop.requests"),
    "max_steps": ("--max-steps", "loop.max_steps"),  # the loop reads it there, bound-checked
    "draft": ("--draft", "speculative.draft"),
    "draft_tokens": ("--draft-tokens", "speculative.draft_tokens"),
    "mla_kernel": ("--mla-kernel", "planner.mla_kernel"),
    "tp": ("--tp", "distributed.tp"),
    "dp_attention": ("--dp-attention", "distributed.dp_attention"),
    "dist_backend": ("--dist-backend", "distributed.backend"),
    "dist_timeout": ("--dist-timeout", "distributed.timeout_s"),
    "dp_split": ("--dp-split", "distributed.dp_split"),
    "overlap": ("--overlap/--no-overlap", "loop.overlap"),
}
"""Flags that set one config key to their value: ``args`` name -> (the flag, the key)."""
BUSY_START = 20
"""The loop step ``--gpu-busy``'s window starts at: past the first prompt chunks and the
compiles the warm-up left (its pace skips the first half of these)."""


@dataclass(frozen=True)
class Overrides:
    """The config keys the command line sets, and the flag (or variable) that set each, so a
    value the config refuses is reported on the flag the user typed, not on the YAML file."""

    values: dict[str, Any]
    flags: dict[str, str]

    def named(self, exc: ConfigError) -> ConfigError:
        """``exc`` reported on the flag that set its field (unchanged if no flag did)."""
        key = exc.field or ""
        owner = next((k for k in self.flags if key == k or key.startswith(k + ".")), None)
        if owner is None:
            return exc
        return ConfigError(
            f"{exc.message} (overrides {key})",
            field=self.flags[owner],
            expected=exc.expected,
            actual=exc.actual,
        )


def _overrides(args: argparse.Namespace, env: Mapping[str, str]) -> Overrides:
    values: dict[str, Any] = {}
    flags: dict[str, str] = {}

    def put(key: str, value: Any, flag: str) -> None:
        values[key] = value
        flags[key] = flag

    for item in getattr(args, "settings", []):
        key, sep, text = item.partition("=")
        if not sep or not key or key != key.strip():
            raise ConfigError(
                "expected KEY=VALUE (a dotted config key)", field="--set", actual=item
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError("the value is not YAML", field="--set", actual=item) from None
        put(key, value, "--set")
    for name, (flag, key) in FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            put(key, value, flag)
    if args.compare_plain:
        put("speculative.compare_plain", True, "--compare-plain")
    if args.staging is not None:
        staging = {"auto": "auto", "graph": True, "copy": False}[args.staging]
        put("planner.staging_in_graph", staging, "--staging")
    if args.no_graphs:
        put("graphs.enabled", False, "--no-graphs")
    if args.batch_invariant:
        put("planner.batch_invariant", True, "--batch-invariant")
    if args.debug:
        put("planner.debug", True, "--debug")
    elif debug_from_env(env):  # the planner reads it too; here it also turns on --tp's digests
        put("planner.debug", True, "PLANNER_DEBUG")
    if args.load_weights:
        put("model.weights", str(args.load_weights), "--load-weights")
    if getattr(args, "digests", False):
        put("distributed.digests", True, "--digests")
    providers = {}
    for item in args.provider:
        op, sep, name = item.partition("=")
        if not sep:
            raise ConfigError("expected OP=PROVIDER", field="--provider", actual=item)
        providers[op] = name
    if providers:
        put("planner.providers", providers, "--provider")
    return Overrides(values, flags)


def check_environment(env: Mapping[str, str]) -> None:
    """Every ``PLANNER_*`` variable ``decode`` reads, checked up front whatever the flags:
    a flag that takes precedence, or a run on several ranks, must not hide a typo."""
    debug_from_env(env)
    env_count(env, ENV_EVERY, 1)
    env_count(env, ENV_KEEP, DEFAULT_KEEP)


def check_flags(config: RunConfig, args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Flags the run would accept and never use are refused, naming the flag."""
    spec = config.speculative
    for flag, given in (
        ("--draft-tokens", args.draft_tokens),
        ("--compare-plain", args.compare_plain),
    ):
        if given and not spec.enabled:
            raise ConfigError(
                "speculative decoding is off: give --draft ngram|mtp, or a config whose "
                "speculative.draft is not none",
                field=flag,
                actual=f"speculative.draft = {spec.draft}",
            )
    if getattr(args, "gpu_busy", None) and config.distributed.world > 1:
        raise ConfigError(
            "the busy fraction profiles one process's loop: run it without --tp and --dp-attention",
            field="--gpu-busy",
            actual=f"{config.distributed.world} ranks",
        )
    if args.dump_dir is None and env_path(env, ENV_DIR) is None:
        for flag, given in (("--dump-every", args.dump_every), ("--dump-keep", args.dump_keep)):
            if given is not None:
                raise ConfigError(
                    f"no plan dumps are written: give --dump-dir or {ENV_DIR}", field=flag
                )


@dataclass(frozen=True)
class Outputs:
    """Where this run writes, every path checked; the dump folder already made."""

    json: Path | None
    weights: Path | None
    dumps: DumpSettings | None


def _dump_settings(args: argparse.Namespace, env: Mapping[str, str]) -> DumpSettings | None:
    """The flags first, then ``PLANNER_DUMP_*``; each value named by where it came from."""
    every = args.dump_every or env_count(env, ENV_EVERY, 1)
    keep = args.dump_keep or env_count(env, ENV_KEEP, DEFAULT_KEEP)
    base, field = args.dump_dir, "--dump-dir"
    if base is None:
        base, field = env_path(env, ENV_DIR), ENV_DIR
    if base is None:
        return None
    return DumpSettings(new_run_dir(base, field), every=every, keep=keep)


def check_outputs(args: argparse.Namespace, env: Mapping[str, str]) -> Outputs:
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
    """Build the engine from the config and flags, serve the workload, print the summary;
    a value the config refuses is reported on the flag that set it."""
    env = dict(os.environ)
    check_environment(env)
    overrides = _overrides(args, env)
    try:
        return _run(args, env, overrides)
    except ConfigError as exc:
        raise overrides.named(exc) from None


@allocation_errors  # an allocation that fails anyway is one line, not a traceback
def _run(args: argparse.Namespace, env: dict[str, str], overrides: Overrides) -> int:
    config = load_run_config(args.config or DEFAULT_DECODE_CONFIG, overrides.values)
    check_flags(config, args, env)
    threads = cpu_threads(args.threads, config.device, env)
    check_memory(config)  # before anything is allocated, on one rank or several
    if config.distributed.world > 1 or launched_by_torchrun():
        return run_ranks(config, args, env, threads)
    outputs = check_outputs(args, env)
    busy = None
    if getattr(args, "gpu_busy", None):  # refused here, before the engine, off CUDA
        busy = GpuBusy(BUSY_START, args.gpu_busy, resolve_device(config.device))
    if threads is not None:
        torch.set_num_threads(threads)  # before the model is built: the first heavy work
    try:
        engine = DecodeEngine(config, dumps=outputs.dumps)
    except BaseException:
        if outputs.dumps is not None:
            outputs.dumps.directory.rmdir()  # made for this run, still empty
        raise
    if outputs.weights:
        _save_weights(engine, outputs.weights)
    compare = config.speculative.enabled and config.speculative.compare_plain
    stop = getattr(args, "stop", None)  # Ctrl-C (the CLI's StopRequest)
    result = engine.run(
        progress=not args.quiet,
        keep_tokens=outputs.json is not None or compare,
        stop=stop,
        busy=busy,
    )
    summary = summarize(engine, result)
    summary["cpu_threads"] = torch.get_num_threads()
    if compare and not result.interrupted:
        summary["plain"] = plain_baseline(config, engine, result, args, stop)
    render(summary)
    if outputs.dumps is not None:
        summary["dump_dir"] = str(outputs.dumps.directory)
        print(_dump_line(engine, outputs.dumps.directory))
    if outputs.json:
        _write_json(outputs.json, {"summary": summary, "tokens": result.tokens})
    if result.interrupted or (summary.get("plain") or {}).get("interrupted"):
        raise Interrupted(_interrupted_line(result, summary, outputs.json))
    return 0


def _interrupted_line(result: RunResult, summary: dict[str, Any], json_path: Path | None) -> str:
    """What the Ctrl-C line says after the summary: which run stopped where, what was written."""
    if result.interrupted:
        said = f"stopped after {result.loop_steps} loop steps, the summary above covers them"
    else:
        said = "the plain comparison run stopped early; the speculative run's summary is whole"
    return said + (f" (and {json_path}, marked interrupted)" if json_path else "")


def run_ranks(
    config: RunConfig, args: argparse.Namespace, env: Mapping[str, str], threads: int | None
) -> int:
    """Several ranks: only the flags that make sense there; per-rank and aggregate summaries.
    Each rank sets ``threads`` (None: torch's own, from ``OMP_NUM_THREADS``) itself."""
    unsupported = [
        ("--save-weights", args.save_weights),
        ("--dump-dir", args.dump_dir),
        ("--compare-plain", args.compare_plain),
        (ENV_DIR, env_path(env, ENV_DIR)),
    ]
    for flag, given in unsupported:
        if given:
            raise ConfigError(
                "not supported with several ranks yet",
                field=flag,
                expected=f"a single-rank run (distributed world {config.distributed.world})",
            )
    if config.speculative.enabled and config.speculative.compare_plain:
        print(
            "note: speculative.compare_plain is not run on several ranks (serve the config on "
            "one rank for the plain comparison)",
            file=sys.stderr,
        )
    json_path = check_output_file(args.json, "--json") if args.json else None
    options = {
        "json": str(json_path) if json_path else None,
        "threads": threads,
    }
    return launch(config, options, getattr(args, "stop", None))


def plain_baseline(
    config: RunConfig,
    engine: DecodeEngine,
    result: RunResult,
    args: argparse.Namespace,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The same workload and model without speculation: its throughput, and whether greedy
    speculative decoding emitted exactly its tokens (``None`` when Ctrl-C stopped it early:
    its tokens are not all there to compare)."""
    plain_config = config.model_copy(
        update={"speculative": config.speculative.model_copy(update={"draft": "none"})}
    )
    plain_engine = DecodeEngine(plain_config, model=engine.model)
    plain = plain_engine.run(progress=not args.quiet, keep_tokens=True, stop=stop)
    summary = summarize(plain_engine, plain)
    return {
        "interrupted": plain.interrupted,
        "tokens_per_second": summary["tokens_per_second"],
        "decode_tokens_per_second": summary["decode_tokens_per_second"],
        "decode_steps": summary["decode_steps"],
        "tokens_equal": None if plain.interrupted else plain.tokens == result.tokens,
    }
