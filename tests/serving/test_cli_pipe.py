"""A reader that closes the pipe early (``python -m planner schema nsa | head``) ends the
command quietly: no ``BrokenPipeError`` traceback, no "Exception ignored" at exit, and
exit status 141 (128 + SIGPIPE, what a shell reports for ``cat`` in the same place) when
the command noticed, 0 when all its output fitted the pipe before the reader left.

The processes close their read end before the command writes anything, so every write
fails: the outcome does not depend on timing. One more reads a line first, as ``head -1``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv32_engine.serving import cli
from tests.support import REPO
from tests.support.dumps import probe_dump


def _closed_early(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with its stdout a pipe whose only reader is already gone."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader leaves before the first byte
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), "", err)


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    path, _ = probe_dump(tmp_path_factory.mktemp("pipe"))
    return path


@pytest.mark.parametrize(
    "argv",
    [["schema", "nsa"], ["backends"], ["ops", "--json"], ["inspect", "{dump}", "--json"]],
    ids=["schema", "backends (rich table)", "ops --json", "inspect --json"],
)
def test_a_closed_pipe_is_quiet(argv, dump):
    proc = _closed_early(*(a.format(dump=dump) for a in argv))
    assert proc.returncode == cli.CLOSED_PIPE, proc.stderr
    assert proc.stderr == "", proc.stderr


def test_a_reader_that_takes_one_line():
    """``| head -1``: whether the command was still writing when the reader left is timing."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", "ops"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) in (0, cli.CLOSED_PIPE) and err == "", err


class _Gone(io.StringIO):
    """A stdout whose reader has gone: every write fails as a pipe's would. Its descriptor
    is a scratch one on /dev/null, so pointing it at /dev/null (as the handlers do) is harmless."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_main_turns_a_broken_pipe_into_the_exit_status(monkeypatch, capsys):
    """In-process: ``main`` returns :data:`CLOSED_PIPE`, whether the command wrote with
    ``print`` (JSON) or through a rich console (which raises SystemExit(1) on its own)."""
    for argv in (["ops", "--json"], ["backends"]):
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            monkeypatch.setattr(sys, "stdout", _Gone(fd))
            assert cli.main(argv) == cli.CLOSED_PIPE
        finally:
            monkeypatch.undo()
            os.close(fd)
    assert capsys.readouterr().err == ""
