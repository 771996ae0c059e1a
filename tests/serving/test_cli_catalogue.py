"""The CLI's catalogue of bad arguments: every command refuses them in one line, exit 2.

Each case is data: the kind (its row in ``docs/reliability.md``), the arguments, the
environment, and what the one line must name (the flag, variable or config field). Every
case runs ``serving.cli.main`` in this process (an exception escaping it fails the test,
as it would print a traceback), and a few run as ``python -m planner`` to see the process
itself: exit status 2, one line on stderr, no ``Traceback``. Nothing a case refuses
writes anything: the checks run before any run starts.

Also here: ``--help`` answers without importing torch, in well under 0.5 s, and the main
job runs with Triton unimportable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.cli import ERROR_PREFIX, main
from dsv32_engine.serving.commands import decode
from dsv32_engine.serving.memory_fit import estimate
from dsv32_engine.serving.run_config import load_run_config
from tests.support import REPO
from tests.support.dumps import probe_dump


@dataclass(frozen=True)
class CliCase:
    kind: str
    argv: Callable[[Path], list[str]]
    """The arguments, given a scratch directory holding ``file``, ``dir``, ``dump``, ..."""
    names: str
    """What the error line must contain: the flag, variable or field."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables (``{tmp}`` is the scratch directory)."""
    not_named: str | None = None
    """What the line must not contain (a flag's value blamed on the default config file)."""


DEFAULT_YAML = "dsv32-tiny.yaml"


def _decode(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["decode", "--quiet", *(a.format(tmp=tmp) for a in args)]


def _args(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [a.format(tmp=tmp) for a in args]


CASES = [
    CliCase("--json in a missing directory", _decode("--json", "/nonexistent/x.json"), "--json"),
    CliCase("--json naming a directory", _decode("--json", "{tmp}/dir"), "--json"),
    CliCase(
        "--save-weights in a missing directory",
        _decode("--save-weights", "/nonexistent/w.safetensors"),
        "--save-weights",
    ),
    CliCase(
        "--save-weights naming a directory",
        _decode("--save-weights", "{tmp}/dir"),
        "--save-weights",
    ),
    CliCase(
        "--json and --save-weights one file",
        _decode("--json", "{tmp}/out", "--save-weights", "{tmp}/out"),
        "--json",
    ),
    CliCase(
        "--load-weights missing",
        _decode("--load-weights", "{tmp}/none.safetensors"),
        "model.weights",
    ),
    CliCase(
        "--load-weights not safetensors",
        _decode("--load-weights", "{tmp}/file"),
        "not a readable safetensors file",
    ),
    CliCase(
        "--load-weights truncated",
        _decode("--load-weights", "{tmp}/truncated.safetensors"),
        "not a readable safetensors file",
    ),
    CliCase(
        "--load-weights of another model",
        _decode("--load-weights", "{tmp}/other.safetensors"),
        "num_hidden_layers differs",
    ),
    CliCase("--dump-dir naming a file", _decode("--dump-dir", "{tmp}/file"), "--dump-dir"),
    CliCase(
        "PLANNER_DUMP_DIR naming a file",
        _decode(),
        "PLANNER_DUMP_DIR",
        {"PLANNER_DUMP_DIR": "{tmp}/file"},
    ),
    CliCase(
        "PLANNER_DUMP_EVERY not a number",
        _decode(),
        "PLANNER_DUMP_EVERY",
        {"PLANNER_DUMP_DIR": "{tmp}/ring", "PLANNER_DUMP_EVERY": "abc"},
    ),
    CliCase(
        "PLANNER_DUMP_KEEP zero",
        _decode(),
        "PLANNER_DUMP_KEEP",
        {"PLANNER_DUMP_DIR": "{tmp}/ring", "PLANNER_DUMP_KEEP": "0"},
    ),
    CliCase("PLANNER_DEBUG not a boolean", _decode(), "PLANNER_DEBUG", {"PLANNER_DEBUG": "maybe"}),
    CliCase(
        "PLANNER_DEBUG not a boolean with --debug",
        _decode("--debug"),
        "PLANNER_DEBUG",
        {"PLANNER_DEBUG": "maybe"},
    ),
    CliCase(
        "PLANNER_DEBUG not a boolean on several ranks",
        _decode("--tp", "2"),
        "PLANNER_DEBUG",
        {"PLANNER_DEBUG": "maybe"},
    ),
    CliCase(
        "PLANNER_DUMP_EVERY not a number without a dump dir",
        _decode(),
        "PLANNER_DUMP_EVERY",
        {"PLANNER_DUMP_EVERY": "abc"},
    ),
    CliCase(
        "PLANNER_DUMP_EVERY not a number with --dump-every",
        _decode("--dump-dir", "{tmp}/ring", "--dump-every", "2"),
        "PLANNER_DUMP_EVERY",
        {"PLANNER_DUMP_EVERY": "abc"},
    ),
    CliCase(
        "PLANNER_DUMP_KEEP zero on several ranks",
        _decode("--tp", "2"),
        "PLANNER_DUMP_KEEP",
        {"PLANNER_DUMP_KEEP": "0"},
    ),
    CliCase(
        "PLANNER_DUMP_DIR on several ranks",
        _decode("--tp", "2"),
        "PLANNER_DUMP_DIR",
        {"PLANNER_DUMP_DIR": "{tmp}/ring"},
    ),
    CliCase("--dump-every without a dump dir", _decode("--dump-every", "2"), "--dump-every"),
    CliCase("--draft-tokens without a draft", _decode("--draft-tokens", "3"), "--draft-tokens"),
    CliCase(
        "--draft-tokens with --draft none",
        _decode("--draft", "none", "--draft-tokens", "3"),
        "--draft-tokens",
    ),
    CliCase("--compare-plain without a draft", _decode("--compare-plain"), "--compare-plain"),
    CliCase(
        "--draft-tokens out of range",
        _decode("--draft", "ngram", "--draft-tokens", "9"),
        "[--draft-tokens]",
        not_named=DEFAULT_YAML,
    ),
    CliCase(
        "--dist-timeout not positive",
        _decode("--dist-timeout", "0"),
        "[--dist-timeout]",
        not_named=DEFAULT_YAML,
    ),
    CliCase("--tp not dividing the heads", _decode("--tp", "3"), "[--tp]"),
    CliCase("--threads zero", _decode("--threads", "0"), "--threads"),
    CliCase("--max-steps negative", _decode("--max-steps", "-1"), "--max-steps"),
    CliCase("--max-steps zero", _decode("--max-steps", "0"), "--max-steps"),
    CliCase("--requests zero", _decode("--requests", "0"), "--requests"),
    CliCase("--requests above its bound", _decode("--requests", "1000000"), "--requests"),
    CliCase("--max-steps above its bound", _decode("--max-steps", "10000000"), "--max-steps"),
    CliCase(
        "workload prompts above their bound",
        _decode(
            "--requests",
            "100000",
            "--set",
            "loop.prompt_len=[8,200]",
            "--set",
            "planner.max_context=512",
        ),
        "--requests",
    ),
    CliCase("--dump-every zero", _decode("--dump-every", "0"), "--dump-every"),
    CliCase("--dump-keep not a number", _decode("--dump-keep", "abc"), "--dump-keep"),
    CliCase("--next-n 3", _decode("--next-n", "3"), "--next-n"),
    CliCase("--provider without a name", _decode("--provider", "page_table"), "--provider"),
    CliCase("--provider unknown", _decode("--provider", "page_table=cutlass"), "page_table"),
    CliCase("--set without a value", _decode("--set", "graphs.ragged"), "--set"),
    CliCase("--set value not YAML", _decode("--set", "planner.max_batch=[1"), "--set"),
    CliCase("--set unknown key", _decode("--set", "graphs.raged=true"), "--set"),
    CliCase("--set bad value", _decode("--set", "planner.ragged_kv_tokens=0"), "--set"),
    CliCase("--config missing", _decode("--config", "{tmp}/none.yaml"), "--config"),
    CliCase("--config not YAML", _decode("--config", "{tmp}/bad.yaml"), "--config"),
    CliCase(
        "--config YAML error names the file",
        _decode("--config", "{tmp}/bad.yaml"),
        'bad.yaml", line 1',
    ),
    CliCase("--config a binary file", _decode("--config", "{tmp}/binary.yaml"), "not a text file"),
    CliCase(
        "--device unknown (decode)",
        _decode("--device", "tpu"),
        "[--device]",
        not_named=DEFAULT_YAML,
    ),
    CliCase("unknown flag", _decode("--max-stpes", "3"), "unrecognized arguments"),
    CliCase("backends --device unknown", _args("backends", "--device", "foo"), "--device"),
    CliCase("schema of an unknown backend", _args("schema", "nope"), "backend"),
    CliCase("schema --mode unknown", _args("schema", "nsa", "--mode", "prefill"), "--mode"),
    CliCase("schema --mode idle", _args("schema", "nsa", "--mode", "idle"), "--mode"),
    CliCase("ops --device unknown", _args("ops", "--device", "foo"), "--device"),
    CliCase("inspect a missing dump", _args("inspect", "{tmp}/none"), "does not exist"),
    CliCase("inspect an empty folder", _args("inspect", "{tmp}/dir"), "dump.json is missing"),
    CliCase(
        "inspect an unknown field",
        _args("inspect", "{tmp}/d", "--field", "nope"),
        "no field 'nope'",
    ),
    CliCase("diff of one plain dump", _args("diff", "{tmp}/d"), "two dumps"),
    CliCase("no command", _args(), "required"),
    CliCase("unknown command", _args("serve"), "invalid choice"),
]
"""Every command with the bad arguments a user is likely to give."""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory, a plain file, a dump, a bad YAML and three bad weights files."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "dir").mkdir()
    (tmp / "file").write_text("not a weights file\n")
    (tmp / "bad.yaml").write_text("planner: [1\n")
    (tmp / "binary.yaml").write_bytes(bytes(range(256)) * 4)  # not UTF-8
    probe_dump(tmp)  # tmp/d
    tiny = DSV32Config.tiny()
    other = tiny.model_copy(update={"num_hidden_layers": 1})
    DSV32Model(other, device="cpu", dtype=torch.float32).save(tmp / "other.safetensors")
    data = (tmp / "other.safetensors").read_bytes()
    (tmp / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    return tmp


def _fill(value: str, tmp: Path) -> str:
    return value.format(tmp=tmp)


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_arguments_are_one_line_errors(case, scratch, capsys, monkeypatch):
    for name in ("PLANNER_DEBUG", "PLANNER_DUMP_DIR", "PLANNER_DUMP_EVERY", "PLANNER_DUMP_KEEP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, _fill(value, scratch))
    before = sorted(p.name for p in scratch.iterdir())
    try:
        code = main(case.argv(scratch))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(ERROR_PREFIX + " "), lines[0]  # one prefix for every command
    assert case.names in lines[0], lines[0]
    assert case.not_named is None or case.not_named not in lines[0], lines[0]
    assert sorted(p.name for p in scratch.iterdir()) == before  # nothing written, no run folder


PROCESS_CASES = ["--json in a missing directory", "PLANNER_DUMP_EVERY not a number"]
PROCESS_CASES += ["backends --device unknown", "--max-steps negative", "--config a binary file"]
PROCESS_CASES += ["--requests above its bound"]


def test_the_process_exits_2_with_one_line(scratch):
    """The same, as a user runs it (one interpreter per case: torch is imported each time)."""
    for case in (c for c in CASES if c.kind in PROCESS_CASES):
        env = {**os.environ, **{k: _fill(v, scratch) for k, v in case.env.items()}}
        cmd = [sys.executable, "-m", "planner", *case.argv(scratch)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (case.kind, proc.stderr)
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (case.kind, proc.stderr)
        assert lines[0].startswith(ERROR_PREFIX + " "), lines[0]
        assert case.names in lines[0] and proc.stdout == "", case.kind


def test_help_imports_no_torch_and_is_quick():
    """``python -m planner --help`` (and every command's) builds the parser without torch."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['planner'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('planner', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    for argv in ([], ["decode"], ["inspect"], ["backends"], ["schema"], ["ops"]):
        cmd = [sys.executable, "-c", probe, *argv, "--help"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "planner", "--help"], cwd=REPO, capture_output=True
    )
    assert proc.returncode == 0 and time.perf_counter() - start < 0.5


NO_TRITON = (
    "import sys, runpy\n"
    "sys.modules['triton'] = None  # 'import triton' raises ImportError, as when not installed\n"
    "sys.argv = ['planner', 'decode', '--quiet', '--requests', '3']\n"
    "runpy.run_module('planner', run_name='__main__')\n"
)


def test_the_main_job_runs_without_triton():
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRITON], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "requests finished" in proc.stdout and "Traceback" not in proc.stderr


CAPPED = (
    "import resource, runpy, sys\n"
    "cap = 8 << 30\n"
    "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
    "sys.argv = ['planner', 'decode', '--quiet', '--config', 'dsv32-small', '--device', 'cpu']\n"
    "try:\n    runpy.run_module('planner', run_name='__main__')\n"
    "except SystemExit:\n"
    # this process image's high-water RSS (ru_maxrss would keep the forking parent's)
    "    print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status')\n"
    "               if l.startswith('VmHWM:')))\n"
    "    raise\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
def test_a_config_too_big_for_a_capped_cpu_is_refused_before_allocating():
    """``dsv32-small`` on the CPU under an 8 GB address-space cap: it ran 48 s and was killed
    by the kernel at 24.3 GB (exit 137, no message); now one line, exit 2, in seconds, and
    the process never held the KV cache it would have allocated first."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(ERROR_PREFIX + " [loop.chunk_tokens] the config needs")
    assert "the largest term is forward activations" in lines[0], lines[0]
    assert "GiB available (" in lines[0] and time.perf_counter() - start < 60
    config = load_run_config("dsv32-small", {"device": "cpu"})
    kv = estimate(config, torch.device("cpu")).term("KV cache").nbytes
    assert int(proc.stdout.strip()) < kv  # its peak RSS: not even the KV cache was made


def test_an_allocation_that_fails_anyway_is_one_line(monkeypatch, capsys):
    """Past the check (the estimate leaves out what is small or hard to know), torch's
    allocator error is one line and exit 2, not a traceback."""

    def engine(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 19327352832 bytes. Error code 12"
        )

    monkeypatch.setattr(decode, "DecodeEngine", engine)
    code = main(["decode", "--quiet"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(ERROR_PREFIX) and "can't allocate memory" in lines[0]


KINDS = [c.kind for c in CASES]
KINDS += ["a config too big for the memory", "an allocation that fails anyway"]
"""Every kind of this catalogue: each has its row in docs/reliability.md."""
