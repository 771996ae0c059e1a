"""``python -m planner``: every command's arguments, and the dispatch to the module that runs it.

Building the parser imports nothing heavy (no torch), so ``--help`` and a
mistyped flag answer at once; a command's module is imported only when that
command runs. Every refusal, whichever command or layer makes it, is one line on
stderr starting with :data:`ERROR_PREFIX`, exit status 2; a reader that closes the
pipe early (``| head``) ends the command quietly with :data:`CLOSED_PIPE`. Ctrl-C ends any
command with one line starting :data:`INTERRUPTED_PREFIX`, exit status :data:`INTERRUPTED`;
``decode`` first finishes the step it is in and prints the summary of the steps that ran
(:class:`StopRequest`), and a second Ctrl-C stops it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsv32_engine import SHIPPED_CONFIGS
from planner.errors import PlanError

DEFAULT_DECODE_CONFIG = "dsv32-tiny"
"""The shipped config ``decode`` runs without ``--config``."""

ERROR_PREFIX = "forward-planner: error:"
"""How every error line of every command starts (argparse's ``prog: error:`` form, under the
distribution's name, the same whether run as ``python -m planner`` or ``forward-planner``)."""

CLOSED_PIPE = 141
"""Exit status when stdout's reader went away (``| head``): 128 + SIGPIPE, what a shell reports
for ``cat`` or ``yes`` in the same place, so ``set -o pipefail`` scripts see the same for this
command as for any other producer, and a cut-short listing is not mistaken for a whole one."""


INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a command it interrupted,
so a script tells a stopped run from a finished (0) or refused (2) one."""

INTERRUPTED_PREFIX = "forward-planner: interrupted"
"""How the one line Ctrl-C leaves on stderr starts, whichever command was running."""


def error_line(message: str) -> str:
    """The one line an error prints: the prefix, then the message with its whitespace folded."""
    return f"{ERROR_PREFIX} {' '.join(message.split())}"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying what the command had done by then: :func:`main` prints it as the one
    line after :data:`INTERRUPTED_PREFIX` (a plain ``KeyboardInterrupt`` gets the bare line)."""


class StopRequest:
    """Ctrl-C while a command runs: a request to stop at the next step boundary for a command
    that summarises what it ran (``decode``: a summary of whole steps needs the loop to end
    between two), else the end, at once.

    While :meth:`installed`, a SIGINT sets :attr:`requested` and runs the :attr:`on_request`
    callbacks (a launcher tells its ranks); a loop reads it between steps. The
    ``presses_to_abort``-th SIGINT (1: a command with no loop to stop; 2: ``decode``, whose
    second Ctrl-C stops at once; ``None``: never, a spawned rank, whose repeats are one key
    press seen twice, the terminal's and its launcher's) runs the :attr:`on_abort` callbacks
    (a launcher kills its ranks), writes the one line and ends the process with
    :data:`INTERRUPTED` there and then. Not a ``KeyboardInterrupt``: raised inside an import,
    one can end the interpreter by SIGINT (-2, not 130) even when :func:`main` caught it,
    and no cleanup of a command being abandoned is worth waiting for.
    """

    def __init__(self, *, presses_to_abort: int | None = 2) -> None:
        self.requested = False
        self.presses = 0
        self.presses_to_abort = presses_to_abort
        self.on_request: list[Callable[[], object]] = []
        self.on_abort: list[Callable[[], object]] = []

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum: int, frame: Any) -> None:
        self.presses += 1
        if self.presses_to_abort is not None and self.presses >= self.presses_to_abort:
            self.abort()
        if not self.requested:
            self.requested = True
            for callback in self.on_request:
                callback()

    def abort(self) -> NoReturn:
        """The callbacks, the one line, and exit status :data:`INTERRUPTED` now."""
        for callback in self.on_abort:
            callback()
        detail = ": stopped at once" if self.presses > 1 else ""
        with contextlib.suppress(OSError):
            os.write(2, f"{INTERRUPTED_PREFIX} (Ctrl-C){detail}\n".encode())
        os._exit(INTERRUPTED)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """This request as the SIGINT handler (only the main thread can install one: elsewhere
        Ctrl-C keeps Python's default), the previous handler restored after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


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
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the loop one step ahead: launch step N+1 before reading step N's tokens "
        "(override loop.overlap; default auto: on CUDA, off on the CPU and with speculative "
        "decoding); --no-overlap waits for each step's tokens, for debugging",
    )
    p.add_argument(
        "--gpu-busy",
        type=count,
        metavar="STEPS",
        help="profile the GPU's activity over STEPS loop steps (from step 20) and report its "
        "busy fraction: device time per step over the unprofiled pace of the steps next to it "
        "(CUDA only)",
    )
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
        "--batch-invariant",
        action="store_true",
        help="every row computes the same bits whatever else is in its batch: speculative "
        "greedy equals plain greedy, chunked prefill equals whole-prompt prefill on the GPU too "
        "(override planner.batch_invariant; docs/batch_invariance.md in the source repository)",
    )
    p.add_argument(
        "--provider",
        action="append",
        default=[],
        metavar="OP=NAME",
        help="force a provider for an op",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="override any config key, dotted, the value read as YAML "
        "(--set graphs.ragged=true --set planner.ragged_kv_tokens=262144); flags win",
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
    p.add_argument(
        "--threads",
        type=count,
        metavar="N",
        help="torch's intra-op CPU threads (per rank with --tp / --dp-attention); default: "
        "$OMP_NUM_THREADS when set, else 1 on a CPU device (the tiny model's matrices are too "
        "small to gain from more, and a busy core stalls every op's thread sync), torch's "
        "default on CUDA",
    )
    _add_distributed(p)
    # Ctrl-C stops the loop between steps and prints what ran (see StopRequest)
    p.set_defaults(run="dsv32_engine.serving.commands.decode:run", stops_between_steps=True)


def _add_distributed(p: Any) -> None:
    g = p.add_argument_group(
        "several ranks (docs/distributed.md in the source repository)",
        "Without torchrun the ranks are spawned here (gloo on the CPU); under torchrun "
        "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank and "
        "WORLD_SIZE must equal --tp x --dp-attention. The two compose (rank r is TP rank "
        "r mod tp of replica r // tp), with speculative decoding (--draft) too.",
    )
    g.add_argument(
        "--tp",
        type=count,
        metavar="N",
        help="tensor-parallel ranks: attention heads (the MTP draft's too) split over the "
        "ranks (N must divide them), every rank plans the same batches with its own planner, "
        "batch signatures agreed every forward, drafts included (override distributed.tp)",
    )
    g.add_argument(
        "--dp-attention",
        type=count,
        metavar="N",
        help="data-parallel attention replicas: requests split over them, a replica without a "
        "batch runs an IDLE batch of its peers' shape (decode, verify, draft), one graph size "
        "agreed per forward (override distributed.dp_attention)",
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
        help="all-gather plan and input digests every forward under --tp (on by default with "
        "--debug)",
    )
    g.add_argument(
        "--dp-split",
        choices=("round_robin", "blocks"),
        help="how requests go to data-parallel ranks (blocks: contiguous, ranks idle for "
        "stretches)",
    )


def _add_discovery(sub: Any) -> None:
    p = sub.add_parser(
        "backends",
        help="registered backends: each plan (by forward mode), its op fields, their providers",
        description="Every registered backend's plans, one table per plan labelled with the "
        "forward modes it serves (NSA: extend/mixed, decode/target_verify/idle, draft_extend), "
        "each op field with its providers, those usable on --device and the one chosen there. "
        "Piped output is never cut to the terminal's width.",
    )
    p.add_argument("--device", default="cpu", help="device to check providers for (default: cpu)")
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output: one object per op field (backend, plan, modes, field, "
        "op, providers, available, chosen)",
    )
    p.set_defaults(run="dsv32_engine.serving.commands.backends:run_backends")

    p = sub.add_parser(
        "schema",
        help="JSON Schema of each of a backend's plans, keyed by forward mode",
        description="Print one JSON object mapping each forward mode the backend plans "
        "(decode, target_verify, extend, mixed, draft_extend, ...) to the JSON Schema of the "
        "plan made for it; modes planned by one class carry the same schema (its title names "
        "the class). An idle batch runs the plan of the mode it is shaped as (decode unless "
        "it says otherwise). With --mode, print just that mode's schema. "
        "E.g. python -m planner schema nsa | jq '.decode.properties | keys'",
    )
    p.add_argument("name", help="backend name, as listed by 'backends'")
    p.add_argument(
        "--mode",
        metavar="MODE",
        help="print only the plan of this forward mode (one JSON Schema, not keyed by mode)",
    )
    p.set_defaults(run="dsv32_engine.serving.commands.backends:run_schema")

    p = sub.add_parser(
        "ops",
        help="the metadata ops a backend can name: providers, which plans use them",
        description="Every registered metadata op (the shared ones of backends.common and each "
        "backend's own): what it computes, its providers and those usable on --device, and "
        "the backends (with modes) whose plans name it. A plugin's schema names an op in "
        "tensor_field(..., op=NAME).",
    )
    p.add_argument("--device", default="cpu", help="device to check providers for (default: cpu)")
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output: one object per op (op, package, description, "
        "providers, available, used_by)",
    )
    p.set_defaults(run="dsv32_engine.serving.commands.backends:run_ops")


def _add_dump_readers(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a plan dump: per field shape, dtype, pointer, checksum, summary",
        description="Show a plan dump written by planner.dumps.dump_plans (as decode --dump-dir "
        "and its debug-mode mismatch hook write them); on a folder of dumps, list them. "
        "From Python: planner.dumps.print_dump / inspect_report.",
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
            "Exit status 0 when equal, 1 when they differ, 2 on error. "
            "From Python: planner.dumps.print_diff / diff_dumps."
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
        self.exit(2, error_line(f"{message} (see: {self.prog} --help)") + "\n")


def count(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (the message names the flag)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def program_name() -> str:
    """How the user started the CLI, for usage lines and ``--help``: ``forward-planner``, the
    command the wheel installs, or ``python -m planner`` (the same ``main``)."""
    return "forward-planner" if Path(sys.argv[0]).name == "forward-planner" else "python -m planner"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=program_name(),
        description="forward-planner: attention metadata planned once per forward batch, "
        "CUDA-graph aware. Installed as the forward-planner command; python -m planner runs "
        "the same commands.",
        epilog=f"Every command reports a refusal as one line on stderr, '{ERROR_PREFIX} ...', "
        f"naming the flag, variable or config field to change, with exit status 2. Piped into a "
        f"reader that stops early (| head), a command ends quietly with status {CLOSED_PIPE}. "
        f"Ctrl-C ends a command with one line and status {INTERRUPTED}; decode first prints the "
        "summary of the steps that ran (a second Ctrl-C stops it at once).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_discovery(sub)
    _add_decode(sub)
    _add_dump_readers(sub)
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Import the module of ``args.run`` (``"module:function"``) and run the command."""
    module, _, function = args.run.partition(":")
    return int(getattr(importlib.import_module(module), function)(args) or 0)


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush cannot fail
    again (Python's "Note on SIGPIPE"); an in-memory stdout (tests) has none to point."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the command; a refusal is one line and 2, a closed stdout pipe is quiet,
    Ctrl-C is one line and :data:`INTERRUPTED` (``decode`` prints its summary first)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        graceful = getattr(args, "stops_between_steps", False)
        stop = args.stop = StopRequest(presses_to_abort=2 if graceful else 1)
        with stop.installed():
            code = dispatch(args)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            if stop.requested:  # pressed after the last step: still 130
                raise Interrupted("after the run had finished; its summary is complete")
        return code
    except PlanError as exc:  # every refusal names its field, flag or variable
        print(error_line(str(exc)), file=sys.stderr)
        return 2
    except BrokenPipeError:
        _stdout_to_devnull()
        return CLOSED_PIPE
    except KeyboardInterrupt as exc:  # Ctrl-C, in any command: no traceback
        # (stdout is not flushed first: its reader may be what the user gave up waiting on)
        detail = " ".join(str(exc).split())
        print(f"{INTERRUPTED_PREFIX} (Ctrl-C){': ' + detail if detail else ''}", file=sys.stderr)
        return INTERRUPTED
    except SystemExit as exc:
        # rich's consoles answer a closed pipe by raising SystemExit(1) while handling the
        # BrokenPipeError (Console.on_broken_pipe, stdout already on /dev/null): the same case
        if isinstance(exc.__context__, BrokenPipeError):
            return CLOSED_PIPE
        raise
