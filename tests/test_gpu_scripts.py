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
from benchmarks.registry import suite
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


CASES = [(script, *command) for script in SCRIPTS for command in commands(script)]
CASES += [("benchmarks/loop/decode_runs.py", *command) for command in decode_run_commands()]


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
    run = {argv[0] for script, target, argv in CASES if target == "-m benchmarks"}
    assert {"ragged_steps", "batch_invariance", "decode_runs", "planner_overhead"} <= run
    assert sum(target == "-m planner" for _, target, _ in CASES) >= 10
    mixed = [argv for _, target, argv in CASES if "--debug" in argv]
    assert mixed and "graphs.ragged=true" in mixed[0]


def test_every_verify_step_is_a_benchmark():
    """A ``gpu_verify.sh`` step is a benchmark's name (``NAME`` or ``NAME:VARIANT``), and the
    commands it runs run that benchmark; ``check_distributed`` runs the two-GPU script its
    judge reads."""
    steps, benchmarks = verify_steps(), suite()
    assert len(steps) > 20 and set(steps) >= NOT_BENCHMARKS
    for pattern, commands in steps.items():
        name = pattern.split(":")[0]
        if name in NOT_BENCHMARKS or pattern == "*":  # "*": an unknown step, refused
            continue
        assert name in benchmarks, f"{VERIFY}: step {pattern} names no benchmark"
        ran = re.findall(r"python3 -m benchmarks (\S+)", commands)
        if name == "check_distributed":
            assert "scripts/gpu_distributed.sh" in commands and not ran
        else:
            assert ran and set(ran) == {name}, f"{VERIFY}: step {pattern} runs {ran}"


def test_a_bad_flag_is_caught(monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="refused its arguments"):
        parse_only("-m benchmarks", ["ragged_steps", "--no-such-flag"], monkeypatch)


def test_a_bad_setting_is_caught(monkeypatch):
    argv = ["decode", "--config", "dsv32-small", "--set", "graphs.raged=true"]
    with pytest.raises(ConfigError, match="graphs.raged"):
        test_a_device_script_command_parses("x.sh", "-m planner", argv, monkeypatch)
