"""Ctrl-C, as a terminal sends it: real SIGINTs to a real ``python -m planner decode``.

The first Ctrl-C ends the loop between two steps and prints the summary of the steps that
ran, marked interrupted (so is ``--json``); then one line on stderr and exit status 130.
A second Ctrl-C stops at once (one line, 130). Several ranks agree to stop before the same
step; a second Ctrl-C kills them, and no process of the job is left behind. No traceback,
ever. Each run is its own session, so a signal to its process group is what a terminal's
Ctrl-C is: one to every process of the job.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsv32_engine.serving.cli import INTERRUPTED, INTERRUPTED_PREFIX
from tests.support import REPO

LONG = ["decode", "--quiet", "--requests", "400"]
"""A run that lasts about a minute on 2 CPU cores: every Ctrl-C lands in it."""


class Run:
    """``python -m planner ARGS`` in a session of its own, timed from its start."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("PLANNER_DUMP_DIR", None)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "planner", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def ctrl_c(self, at: float, *, group: bool = True) -> None:
        """SIGINT ``at`` seconds after the start: to the whole process group, as a terminal
        sends it, or (``group=False``) to the command's own process only, as ``kill -INT``."""
        time.sleep(max(0.0, self.start + at - time.monotonic()))
        if group:
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGINT)

    def finish(self, timeout: float = 120) -> tuple[str, str, float]:
        """stdout, stderr, and the seconds from the last call to the end."""
        since = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return out, err, time.monotonic() - since

    def started(self, processes: int, within: float = 60.0) -> float:
        """Wait until the job's session holds ``processes`` processes (the launcher and what
        it started): the seconds since the start, for :meth:`ctrl_c`."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if len(_session(self.proc.pid)) >= processes:
                return time.monotonic() - self.start
            time.sleep(0.02)
        raise AssertionError(f"the job never held {processes} processes in {within} s")

    def leaves_nothing(self, within: float = 15.0) -> bool:
        """Whether every process of the job is gone (reaped), waiting up to ``within`` s: a
        rank left running would still be in the session's process group."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (``/proc/PID/stat``'s sixth field)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid:
            found.append(int(entry))
    return found


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(INTERRUPTED_PREFIX), err
    return lines[0]


@pytest.mark.parametrize("seconds", [2, 4, 6])
def test_ctrl_c_prints_the_summary_of_the_steps_that_ran(seconds, tmp_path):
    out_json = tmp_path / "run.json"
    run = Run(*LONG, "--json", str(out_json))
    run.ctrl_c(seconds)
    out, err, _ = run.finish()
    assert run.proc.returncode == INTERRUPTED, err
    line = _one_line(err)
    summary = json.loads(out_json.read_text())["summary"]
    assert summary["interrupted"] is True
    assert f"after {summary['loop_steps']} loop steps" in line
    assert "INTERRUPTED (Ctrl-C)" in out and "requests finished" in out  # the partial table
    assert summary["requests_unfinished"] > 0  # the workload was cut short, and says so
    assert summary["requests_finished"] + summary["requests_unfinished"] == 400
    assert summary["generated_tokens"] >= summary["decode_tokens"]


def test_a_second_ctrl_c_stops_at_once():
    """Both presses land while the command still imports: the first only asks the loop to
    stop (it would print a summary seconds later, after the engine is built); the second
    ends the command there, with no summary."""
    run = Run(*LONG)
    run.ctrl_c(1.0)
    run.ctrl_c(1.3)
    out, err, took = run.finish()
    assert run.proc.returncode == INTERRUPTED, err
    assert _one_line(err) == f"{INTERRUPTED_PREFIX} (Ctrl-C): stopped at once"
    assert "requests finished" not in out
    assert took < 1.5, took


def test_ranks_stop_together_on_a_ctrl_c_sent_to_the_launcher(tmp_path):
    """``kill -INT`` to the launcher alone: it tells its ranks, they agree on the step to
    stop before, each prints its line and rank 0 the aggregate, all marked interrupted."""
    out_json = tmp_path / "run.json"
    run = Run(*LONG, "--dp-attention", "2", "--json", str(out_json))
    run.ctrl_c(12, group=False)  # about when the ranks have built their engines (2 cores)
    out, err, _ = run.finish()
    assert run.proc.returncode == INTERRUPTED, err
    assert "every rank stopped before the same loop step" in _one_line(err)
    total = json.loads(out_json.read_text())["aggregate"]
    steps = total["loop_steps"]
    assert total["interrupted"] and len(set(steps)) == 1, total
    assert f"rank 0/2 (cpu) (INTERRUPTED after {steps[0]} loop steps)" in out
    assert f"rank 1/2 (cpu) (INTERRUPTED after {steps[0]} loop steps)" in out
    assert total["requests_finished"] < 400 and total["agree"]
    assert run.leaves_nothing()


def test_a_second_ctrl_c_kills_every_rank_at_once():
    """Two presses at a terminal (the whole process group), while the ranks start: the
    launcher kills them on the second and ends with one line; no rank is left behind."""
    run = Run(*LONG, "--dp-attention", "2")
    at = run.started(3)  # the launcher and a rank at least: the ranks are starting
    run.ctrl_c(at)
    run.ctrl_c(at + 0.5)
    out, err, took = run.finish()
    assert run.proc.returncode == INTERRUPTED, err
    assert _one_line(err) == f"{INTERRUPTED_PREFIX} (Ctrl-C): stopped at once"
    assert "aggregate:" not in out
    assert took < 5, took
    assert run.leaves_nothing()


def test_commands_without_a_loop_end_on_ctrl_c_with_one_line():
    """Any command: Ctrl-C is the one line and 130, whatever it was doing (here ``schema``,
    48 KB of JSON into a 4 KB pipe nobody reads yet: its write blocks until the Ctrl-C)."""
    run = Run("schema", "nsa")
    fcntl.fcntl(run.proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    run.ctrl_c(2)
    out, err, _ = run.finish(timeout=30)
    assert run.proc.returncode == INTERRUPTED, err
    assert _one_line(err) == f"{INTERRUPTED_PREFIX} (Ctrl-C)"
