"""``decode``'s CPU threads: ``--threads`` wins, an explicit ``OMP_NUM_THREADS`` is kept, and a
CPU run otherwise takes one intra-op thread (the tiny model's matrices are too small for a
second to pay, and a busy neighbour core stalls every op's thread sync); ranks get the same.

The engine is replaced by a stub that stops the run once the threads are set, and
``torch.set_num_threads`` by a recorder, so nothing here builds a model or changes the
test process's threads.
"""

from __future__ import annotations

import pytest
import torch

from dsv32_engine.serving.cli import main
from dsv32_engine.serving.commands import decode
from dsv32_engine.serving.launch import CPU_THREADS, cpu_threads


class _Stop(Exception):
    """Raised where the engine would be built: the threads are set by then."""


def _stop(*args, **kwargs):
    raise _Stop


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """What ``decode`` passed to ``torch.set_num_threads``."""
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(decode, "DecodeEngine", _stop)
    for name in ("OMP_NUM_THREADS", "PLANNER_DEBUG", "PLANNER_DUMP_DIR"):
        monkeypatch.delenv(name, raising=False)
    return seen


@pytest.mark.parametrize(
    ("requested", "device", "env", "expected"),
    [
        (None, "cpu", {}, CPU_THREADS),
        (None, "cpu", {"OMP_NUM_THREADS": "2"}, None),
        (None, "cpu", {"OMP_NUM_THREADS": " "}, CPU_THREADS),
        (3, "cpu", {"OMP_NUM_THREADS": "2"}, 3),
        (None, "cuda", {}, None),
        (2, "cuda:1", {}, 2),
    ],
)
def test_cpu_threads(requested, device, env, expected):
    assert cpu_threads(requested, device, env) == expected


def test_a_cpu_run_defaults_to_one_thread(calls):
    with pytest.raises(_Stop):
        main(["decode", "--quiet"])
    assert calls == [CPU_THREADS] == [1]


def test_the_flag_wins(calls, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(_Stop):
        main(["decode", "--quiet", "--threads", "2"])
    assert calls == [2]


def test_an_explicit_omp_num_threads_is_kept(calls, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(_Stop):
        main(["decode", "--quiet"])
    assert calls == []


def test_every_rank_is_given_the_setting(calls, monkeypatch):
    """The launcher hands the resolved count to each rank (``rank_main`` sets it there)."""
    launched = []
    monkeypatch.setattr(
        decode, "launch", lambda config, options, stop=None: launched.append(options) or 0
    )
    assert main(["decode", "--quiet", "--tp", "2"]) == 0
    assert main(["decode", "--quiet", "--tp", "2", "--threads", "2"]) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["decode", "--quiet", "--tp", "2"]) == 0
    assert [o["threads"] for o in launched] == [CPU_THREADS, 2, None]
    assert calls == []  # the launching process itself serves nothing
