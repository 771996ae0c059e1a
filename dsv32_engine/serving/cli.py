"""``python -m planner``: every command's arguments, and the dispatch to the module that runs it.

Building the parser imports nothing heavy (no torch), so ``--help`` and a
mistyped flag answer at once; a command's module is imported only when that
command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsv32_engine import SHIPPED_CONFIGS
from planner.errors import PlanError

DEFAULT_DECODE_CONFIG = "dsv32-tiny"
"""The shipped config ``decode`` runs without ``--config``."""


def _add_decode(sub: Any) -> None:
    p = sub.add_parser(
        "decode",
        help="run DeepSeek-V3.2 decode through the planner loop (CPU tiny model by default)",
        description="Serve a synthetic workload with continuous batching: every decode step goes "
        "through the planner and the graph runner; a summary is printed at the end.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML run config: a file, or the name of a config shipped with the package ("
        + ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
        + f"; default: {DEFAULT_DECODE_CONFIG}; they live in {SHIPPED_CONFIGS})",
    )
    p.add_argument("--device", help="override the config's device (cpu, cuda)")
    p.add_argument("--requests", type=count, help="override loop.requests (>= 1)")
    p.add_argument(
        "--max-steps",
        type=count,
        help="stop after this many loop steps (>= 1); default: the config's loop.max_steps "
        "(100,000 unless the YAML says otherwise). Either way the run ends as soon as every "
        "request has finished",
    )
    p.add_argument(
        "--draft",
        choices=("none", "ngram", "mtp"),
        help="speculative decoding with this draft (override speculative.draft)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        help="rows per request in target verify, 2..8 (override speculative.draft_tokens)",
    )
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="also serve the workload without speculation and report both",
    )
    p.add_argument(
        "--mla-kernel",
        choices=("auto", "triton", "torch", "flashinfer"),
        help="sparse MLA kernel (override planner.mla_kernel); flashinfer plans FlashInfer's MLA "
        "kernel once per decode / verify batch",
    )
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    p.add_argument(
        "--staging",
        choices=("auto", "graph", "copy"),
        help="how a replay's staged inputs reach the device (override planner.staging_in_graph): "
        "graph: the captured graph pulls them from pinned memory; copy: one host-to-device copy "
        "before the launch; auto: graph whenever ops run in the graph",
    )
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
    p.add_argument(
        "--load-weights",
        type=Path,
        help="safetensors weights saved by --save-weights; their model config must equal the "
        "configured one",
    )
    p.add_argument(
        "--save-weights", type=Path, help="save the model's weights (safetensors) before running"
    )
    p.add_argument(
        "--dump-dir",
        type=Path,
        help="write plan dumps into a new run-NNNN folder here (default: $PLANNER_DUMP_DIR)",
    )
    p.add_argument(
        "--dump-every",
        type=count,
        help="dump every Nth forward step (default: $PLANNER_DUMP_EVERY, else 1)",
    )
    p.add_argument(
        "--dump-keep",
        type=count,
        help="keep the last N step dumps (default: $PLANNER_DUMP_KEEP, else 8)",
    )
    p.add_argument(
        "--json", type=Path, help="also write the summary and the generated tokens as JSON here"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_distributed(p)
    p.set_defaults(run="dsv32_engine.serving.commands.decode:run")


def _add_distributed(p: Any) -> None:
    g = p.add_argument_group(
        "several ranks (docs/distributed.md)",
        "Without torchrun the ranks are spawned here (gloo on the CPU); under torchrun "
        "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank and "
        "WORLD_SIZE must equal --tp or --dp-attention.",
    )
    g.add_argument(
        "--tp",
        type=count,
        metavar="N",
        help="tensor-parallel ranks: attention heads split over the ranks (N must divide them), "
        "every rank plans the same batches with its own planner, batch signatures agreed "
        "every step (override distributed.tp)",
    )
    g.add_argument(
        "--dp-attention",
        type=count,
        metavar="N",
        help="data-parallel attention ranks: requests split over the ranks, idle ranks run "
        "IDLE batches, one graph size agreed per step (override distributed.dp_attention)",
    )
    g.add_argument(
        "--dist-backend",
        choices=("auto", "gloo", "nccl"),
        help="collective backend (default auto: nccl on CUDA, gloo on the CPU)",
    )
    g.add_argument(
        "--dist-timeout",
        type=float,
        metavar="SECONDS",
        help="collective timeout: a stalled rank fails the run after this long (default 300)",
    )
    g.add_argument(
        "--digests",
        action="store_true",
        help="all-gather plan digests every step under --tp (on by default with --debug)",
    )
    g.add_argument(
        "--dp-split",
        choices=("round_robin", "blocks"),
        help="how requests go to data-parallel ranks (blocks: contiguous, ranks idle for "
        "stretches)",
    )


def _add_dump_readers(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a plan dump: per field shape, dtype, pointer, checksum, summary",
        description="Show a plan dump written by serving.dumps (or a DumpRing / mismatch hook).",
    )
    p.add_argument("dump", metavar="DIR", help="dump directory (holds dump.json)")
    p.add_argument("--field", metavar="NAME", help="only this field: NAME or BACKEND.NAME")
    p.add_argument("--full", action="store_true", help="print the full contents of the fields")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run="dsv32_engine.serving.commands.inspect:run")

    p = sub.add_parser(
        "diff",
        help="compare two plan dumps field by field",
        description=(
            "Compare two plan dumps field by field: shape, dtype, data pointer, differing "
            "elements with their indices and values, rows, scalars. With one argument, a "
            "mismatch directory: compares its replayed/ and eager/ dumps. "
            "Exit status 0 when equal, 1 when they differ, 2 on error."
        ),
    )
    p.add_argument("a", metavar="A", help="first dump (or a mismatch-N directory)")
    p.add_argument("b", metavar="B", nargs="?", help="second dump")
    p.add_argument(
        "--pointers",
        action="store_true",
        help="count differing data pointers as a difference (two replays of one capture)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run="dsv32_engine.serving.commands.diff:run")


class Parser(argparse.ArgumentParser):
    """Usage mistakes as one line on stderr (exit 2), like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def count(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (the message names the flag)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m planner",
        description="forward-planner: attention metadata planned once per forward batch, CUDA-graph aware.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "backends", help="registered backends, their ops and the providers usable here"
    )
    p.add_argument("--device", default="cpu", help="device to check providers for (default: cpu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run="dsv32_engine.serving.commands.backends:run_backends")

    p = sub.add_parser("schema", help="JSON Schema of a backend's plan")
    p.add_argument("name", help="backend name, as listed by 'backends'")
    p.set_defaults(run="dsv32_engine.serving.commands.backends:run_schema")

    _add_decode(sub)
    _add_dump_readers(sub)
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Import the module of ``args.run`` (``"module:function"``) and run the command."""
    module, _, function = args.run.partition(":")
    return int(getattr(importlib.import_module(module), function)(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return dispatch(args)
    except PlanError as exc:  # every refusal names its field or flag: one line, exit 2
        message = " ".join(str(exc).split())
        print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
        return 2
