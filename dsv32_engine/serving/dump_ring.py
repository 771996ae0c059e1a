"""Dumping from a running loop: the last N steps, and every debug-mode mismatch.

A stale-metadata bug shows up thousands of steps in, and the step that
matters is usually just before the one that failed. :class:`DumpRing` keeps
the most recent dumps on disk and deletes older ones, so it can stay on for a
whole run; :func:`install_mismatch_dumps` makes a failed debug check leave
the evidence (both the replayed and the eager plan) before it raises.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv32_engine.serving.outputs import env_count
from planner.debug import diff_plans
from planner.dumps import INDEX, dump_plans, fsync_dir, write_synced
from planner.errors import ConfigError, DumpError

if TYPE_CHECKING:
    from planner.batch import ForwardBatch
    from planner.planner import Planner
from planner.plans import PlanSet

logger = logging.getLogger(__name__)

ENV_DIR = "PLANNER_DUMP_DIR"
ENV_EVERY = "PLANNER_DUMP_EVERY"
ENV_KEEP = "PLANNER_DUMP_KEEP"
DEFAULT_KEEP = 8

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MISMATCH_DIR = re.compile(r"^mismatch-(\d+)$")


@dataclass(frozen=True)
class DumpSettings:
    """Where a run dumps plans: every ``every``-th decode step (the last ``keep``), and mismatches."""

    directory: Path
    every: int = 1
    keep: int = DEFAULT_KEEP


def step_dir_name(step: int) -> str:
    """``step-000123``: zero-padded so a directory listing sorts by step."""
    return f"step-{step:06d}"


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            "must be a positive integer", field=name, expected="integer >= 1", actual=value
        )
    return value


class DumpRing:
    """Dump the plans of selected steps into ``directory/step-NNNNNN``, keeping the last few.

    A step is dumped when it is a multiple of ``every`` and, if ``steps`` is
    given, in ``steps``. After each dump, the oldest step directories beyond
    ``keep_last`` are deleted. Step directories already in ``directory`` (a
    previous run) count towards ``keep_last``, oldest first, so restarting a
    loop never grows the directory without bound. Nothing else in the
    directory is touched.

    Dumping is a debugging aid: a failed write is logged, counted in
    ``failures`` and skipped, never allowed to stop the loop it observes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 1,
        steps: Container[int] | None = None,
        keep_last: int = DEFAULT_KEEP,
    ) -> None:
        self.directory = Path(directory)
        self.every = _positive("every", every)
        self.keep_last = _positive("keep_last", keep_last)
        self.steps = steps
        self.failures = 0
        self._kept: deque[Path] = deque(self._existing())

    def _existing(self) -> list[Path]:
        """Step dumps left by an earlier run, oldest first (by mtime, then step)."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / INDEX).is_file():
                found.append((entry.stat().st_mtime, int(match.group(1)), entry))
        return [path for _, _, path in sorted(found)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DumpRing | None:
        """The ring ``PLANNER_DUMP_DIR`` / ``_EVERY`` / ``_KEEP`` ask for; None when the dir is unset.

        Bad values raise :class:`ConfigError` naming the variable: a typo must
        not silently turn dumping off or make it dump every step forever.
        """
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            return None
        return cls(
            directory,
            every=env_count(env, ENV_EVERY, 1),
            keep_last=env_count(env, ENV_KEEP, DEFAULT_KEEP),
        )

    def wants(self, step: int) -> bool:
        """Whether ``step`` would be dumped (cheap: call it before building anything)."""
        if step % self.every:
            return False
        return self.steps is None or step in self.steps

    def maybe_dump(
        self, step: int, plans: PlanSet, batch: ForwardBatch | None = None
    ) -> Path | None:
        """Dump ``plans`` if ``step`` is selected; return the dump's path, else None."""
        if not self.wants(step):
            return None
        path = self.directory / step_dir_name(step)
        try:
            dump_plans(plans, path, step=step, batch=batch, label=f"step {step}")
        except DumpError as exc:
            self.failures += 1
            logger.error("plan dump of step %d failed: %s", step, exc)
            return None
        if path in self._kept:
            self._kept.remove(path)  # re-dumped: now the newest
        self._kept.append(path)
        while len(self._kept) > self.keep_last:
            shutil.rmtree(self._kept.popleft(), ignore_errors=True)
        return path

    @property
    def kept(self) -> list[Path]:
        """The step dumps on disk, oldest first."""
        return list(self._kept)


class MismatchDumper:
    """The ``on_mismatch`` hook: dumps both sides of a failed debug check.

    Writes ``directory/mismatch-N/{replayed,eager}`` (N counts up past any
    existing ones) plus ``mismatch.json`` with the differing fields, as one
    atomic directory, logs where, and records it in ``paths``. It never
    raises: the planner's ``ReplayError`` that follows is the error that
    matters, and a failing dump must not replace it.
    """

    def __init__(
        self, directory: str | os.PathLike[str], chained: Callable[..., Any] | None = None
    ):
        self.directory = Path(directory)
        self.chained = chained
        self.paths: list[Path] = []

    def _next_path(self) -> Path:
        taken = [-1]
        if self.directory.is_dir():
            for entry in self.directory.iterdir():
                match = _MISMATCH_DIR.match(entry.name)
                if match:
                    taken.append(int(match.group(1)))
        return self.directory / f"mismatch-{max(taken) + 1}"

    def __call__(self, batch: ForwardBatch, replayed: PlanSet, eager: PlanSet) -> None:
        try:
            self._dump(batch, replayed, eager)
        except Exception as exc:  # the ReplayError about to be raised must win
            logger.error("could not dump the plan mismatch: %s", exc)
        if self.chained is not None:
            self.chained(batch, replayed, eager)

    def _dump(self, batch: ForwardBatch, replayed: PlanSet, eager: PlanSet) -> None:
        path = self._next_path()
        summary = [m.describe() for m in diff_plans(replayed, eager)]
        staging = self.directory / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir(parents=True)
        try:
            dump_plans(replayed, staging / "replayed", batch=batch, label="replayed")
            dump_plans(eager, staging / "eager", batch=batch, label="eager")
            note = {"mismatches": summary, "replayed": "replayed", "eager": "eager"}
            write_synced(staging / "mismatch.json", (json.dumps(note, indent=1) + "\n").encode())
            fsync_dir(staging)
            os.rename(staging, path)  # fails rather than merge if another process took N
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.paths.append(path)
        logger.warning(
            "plan mismatch dumped to %s (%s); compare with: python -m planner diff %s",
            path,
            "; ".join(summary) or "padding rows only",
            path,
        )


def install_mismatch_dumps(planner: Planner, directory: str | os.PathLike[str]) -> MismatchDumper:
    """Make ``planner.verify`` dump both plans into ``directory`` before it raises.

    Any hook already installed still runs, after the dump.
    """
    dumper = MismatchDumper(directory, chained=planner.on_mismatch)
    planner.on_mismatch = dumper
    return dumper
