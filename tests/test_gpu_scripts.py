"""The device scripts' commands parse here, before a GPU call spends minutes on a typo.

A device call is scarce (minutes of a lent H200 per session), and a command that names a
removed config, a flag a benchmark no longer has, or a misspelt benchmark fails only there.
Each ``python3`` command of ``scripts/gpu_verify.sh`` and ``scripts/gpu_old_new.sh`` is
read out of the script (continuation lines joined, ``$OUT`` and the script's own arrays
expanded), and so is each decode CLI run of the ``decode_runs`` benchmark (its cases); each
is run up to its argument parser (``ArgumentParser.parse_args`` stops it once the arguments
parse), and a ``--config`` it names must resolve to a shipped config (for ``planner
decode``, the config must load with the command's flags and ``--set`` keys). Every step of
``gpu_verify.sh`` but ``gpu_tests`` is a benchmark's name (``python -m benchmarks`` lists
them), and its command runs that benchmark.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks.loop import decode_runs
from benchmarks.registry import step_argv, suite
from dsv32_engine.serving.commands.decode import _overrides
from dsv32_engine.serving.run_config import load_run_config, resolve_config
from planner.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("scripts/gpu_verify.sh", "scripts/gpu_old_new.sh")
VERIFY = "scripts/gpu_verify.sh"
NOT_BENCHMARKS = {"gpu_tests"}
"""``gpu_verify.sh``'s steps that are not a benchmark's name: pytest over the GPU tests."""
SKIPPED_MODULES = {"pip", "pytest", "torch.distributed.run"}
"""Commands of other tools: their arguments are theirs."""
_COMMAND = re.compile(r"python3 (-m [\w.]+|[\w/]+\.py)((?:[^;|&>)\n]|\|\|)*)")


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def _arrays(text: str) -> dict[str, str]:
    """The script's ``NAME=(...)`` arrays, as the words ``"${NAME[@]}"`` expands to."""
    return {m[1]: m[2] for m in re.finditer(r"^(\w+)=\(([^)]*)\)", text, re.MULTILINE)}


def commands(script: str) -> list[tuple[str, list[str]]]:
    """``(target, argv)`` of each ``python3`` command in ``script``; ``target`` is
    ``-m module`` or a path."""
    text = (REPO / script).read_text()
    arrays = _arrays(text)
    text = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    found = []
    for m in _COMMAND.finditer(text):
        target, tail = m[1], m[2]
        if target.startswith("-m ") and target[3:] in SKIPPED_MODULES:
            continue
        for name, words in arrays.items():
            tail = tail.replace(f'"${{{name}[@]}}"', words)
        tail = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", tail)  # ${VAR:-default}
        tail = tail.replace("$NEW", str(REPO)).replace("@JSON@", "$OUT/x.json")
        tail = tail.replace("$OUT", "/tmp/out").replace('"', "")
        found.append((target, shlex.split(tail)))
    return found


def decode_run_commands() -> list[tuple[str, list[str]]]:
    """``(target, argv)`` of each decode CLI run of the ``decode_runs`` benchmark's cases."""
    found = []
    for config, args in decode_runs.CASES.values():
        cmd = decode_runs.command(config, args, None, Path("/tmp/out/x.json"), 0, [])
        assert cmd[1:3] == ["-m", "planner"]
        found.append(("-m planner", cmd[3:]))
    return found


def verify_steps() -> dict[str, str]:
    """``gpu_verify.sh``'s steps: each arm of ``one``'s ``case`` (``NAME`` or
    ``NAME:VARIANT``, ``*`` for any) and its commands, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (REPO / VERIFY).read_text())
    body = text[text.index('case "$step" in') : text.index("    esac")]
    arms = re.split(r"^    ([\w:*]+)\)", body, flags=re.MULTILINE)[1:]
    return {pattern: commands for pattern, commands in zip(arms[::2], arms[1::2])}


def parse_only(target: str, argv: list[str], monkeypatch: pytest.MonkeyPatch):
    """Run ``target`` as ``__main__`` with ``argv`` up to its ``parse_args``."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.chdir(REPO)
    name = target[3:] if target.startswith("-m ") else target
    monkeypatch.delitem(sys.modules, name, raising=False)  # run afresh, as python3 would
    monkeypatch.delitem(sys.modules, f"{name}.__main__", raising=False)  # a package's entry
    monkeypatch.setattr(sys, "path", list(sys.path))  # a script's own sys.path.insert undone
    monkeypatch.setattr(sys, "argv", [name, *argv])
    try:
        if target.startswith("-m "):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(REPO / name), run_name="__main__")
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exc:
        pytest.fail(f"python3 {target} {shlex.join(argv)}: refused its arguments ({exc.code})")
    pytest.fail(f"python3 {target} {shlex.join(argv)}: ended without parsing arguments")


def step_commands() -> list[tuple[str, str, list[str]]]:
    """``(step, target, argv)`` of every run a benchmark declares as a ``gpu_verify.sh`` step
    (its ``GPU_STEPS``); a ``*`` run (any variant) once per case the benchmark knows."""
    found = []
    for name, bench in suite().items():
        for variant in bench.gpu_steps:
            variants = [variant]
            if variant == "*":
                variants = sorted(bench.load().CASES)
            for v in variants:
                step = f"{name}:{v}" if v else name
                _, argv = step_argv(step, "/tmp/out")
                found.append((step, f"-m {bench.module}", argv))
    return found


CASES = [(script, *command) for script in SCRIPTS for command in commands(script)]
CASES += [("benchmarks/loop/decode_runs.py", *command) for command in decode_run_commands()]
CASES += [(f"{VERIFY} {step}", target, argv) for step, target, argv in step_commands()]


@pytest.mark.parametrize(
    ("script", "target", "argv"), CASES, ids=[f"{s}:{t}:{i}" for i, (s, t, _) in enumerate(CASES)]
)
def test_a_device_script_command_parses(script, target, argv, monkeypatch):
    namespace = parse_only(target, argv, monkeypatch)
    config = getattr(namespace, "config", None)
    if isinstance(config, str):
        assert resolve_config(config).is_file(), f"{script}: {config}"
    if target == "-m planner" and namespace.command == "decode":
        load_run_config(namespace.config, _overrides(namespace, {}).values)


def test_the_commands_are_found():
    """The reader finds every step's command (a script it reads as empty checks nothing)."""
    targets = {target for _, target, _ in CASES}
    assert {"-m planner", "-m benchmarks"} <= targets
    stepped = {target.rsplit(".", 1)[-1] for script, target, _ in CASES if " " in script}
    assert {"ragged_steps", "batch_invariance", "decode_runs", "planner_overhead"} <= stepped
    assert sum(target == "-m planner" for _, target, _ in CASES) >= 10
    debug = [argv for _, target, argv in CASES if "--debug" in argv]
    assert debug and "dsv32-small-arrivals" in debug[0]  # mixed under ragged graphs: the default


def test_every_verify_step_is_a_benchmark():
    """``gpu_verify.sh`` writes no benchmark's command line: a step runs ``python -m
    benchmarks step STEP``, whose arguments the benchmark declares (``GPU_STEPS``). Its only
    arms of its own: ``gpu_tests`` (pytest) and ``check_distributed`` (the two-GPU script its
    judge reads). Every benchmark that runs on a GPU declares its plain step."""
    steps = verify_steps()
    assert set(steps) == {"gpu_tests", "check_distributed", "*"}
    assert "python3 -m benchmarks step" in steps["*"]
    assert "scripts/gpu_distributed.sh" in steps["check_distributed"]
    benchmarks = suite()
    cpu_only = {"sparse_mla_sm90_report", "check_distributed"}
    for name, bench in benchmarks.items():
        if name not in cpu_only:
            assert "" in bench.gpu_steps, f"{name}: no GPU_STEPS[''] (its gpu_verify.sh step)"
    with pytest.raises(ValueError, match="closest: planner_overhead"):
        step_argv("planner_overhed", "/tmp/out")
    with pytest.raises(ValueError, match=r"its steps: model_floor\)"):
        step_argv("model_floor:nope", "/tmp/out")


def test_a_bad_flag_is_caught(monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="refused its arguments"):
        parse_only("-m benchmarks", ["ragged_steps", "--no-such-flag"], monkeypatch)


def test_a_bad_setting_is_caught(monkeypatch):
    argv = ["decode", "--config", "dsv32-small", "--set", "graphs.raged=true"]
    with pytest.raises(ConfigError, match="graphs.raged"):
        test_a_device_script_command_parses("x.sh", "-m planner", argv, monkeypatch)
