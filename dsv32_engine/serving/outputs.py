"""What a command writes, checked before it starts: files, the dump folder, the environment.

A run that fails at its very end because ``--json`` names a missing directory has lost
its results; a dump directory that is a file makes every dump fail, one log line each.
Every path a command will write is therefore checked (and the dump folder made) before
any work, and every refusal is a ``ConfigError`` naming the flag or variable to change.
Each run dumps into a new ``run-NNNN`` folder of the dump directory, so a second run
never deletes the first run's dumps.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from planner.errors import ConfigError

RUN_DIR = re.compile(r"^run-(\d+)$")


def env_count(env: Mapping[str, str], name: str, default: int) -> int:
    """An environment variable holding an integer >= 1; unset or blank: ``default``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ConfigError(
            "must be a positive integer", field=name, expected="integer >= 1", actual=repr(raw)
        )
    return value


def env_path(env: Mapping[str, str], name: str) -> Path | None:
    """An environment variable holding a path; unset or blank: None."""
    raw = env.get(name, "").strip()
    return Path(raw) if raw else None


def _probe(directory: Path, field: str) -> None:
    """Create and remove a file in ``directory``: the one test of writability that is true."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"cannot write in {directory}: {exc.strerror or exc}", field=field
        ) from None


def check_output_file(path: Path, field: str) -> Path:
    """``path`` can be written as a file: not a directory, in an existing writable directory."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a file", field=field)
    parent = path.parent
    if not parent.exists():
        raise ConfigError(f"no such directory: {parent}", field=field, actual=str(path))
    if not parent.is_dir():
        raise ConfigError(f"{parent} is not a directory", field=field, actual=str(path))
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{path} is not writable", field=field)
    _probe(parent, field)
    return path


def new_run_dir(base: Path, field: str) -> Path:
    """Make ``base`` if needed and a new ``base/run-NNNN`` in it (one past the highest)."""
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{base} exists and is not a directory", field=field)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {base}: {exc.strerror or exc}", field=field) from None
    _probe(base, field)
    taken = [int(m.group(1)) for e in base.iterdir() if (m := RUN_DIR.match(e.name))]
    number = max(taken, default=0) + 1
    while True:
        path = base / f"run-{number:04d}"
        try:
            path.mkdir()
        except FileExistsError:  # another run took it meanwhile
            number += 1
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create {path}: {exc.strerror or exc}", field=field) from None
        return path
