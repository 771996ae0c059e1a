"""Compiled screens for the planner's hot paths, built from C with the system's compiler.

Four live here: the staging screen, the eager host pass's runner (``host_pass.c``, over
the twins backends compile against ``twin.h``; with the screen in front, in one call), the
lengths' max and sum, and the eager lane's whole submission (``lane_submit.c``: the screen,
the pass, the copy and the launches); backends build their own C (FlashInfer's host arrays, the host twins) through :func:`load`.

Why: a replay's staging (write five inputs and their padding into the pinned buffer,
range-check them, look for a repeated KV slot or request, compare positions with the
lengths) is a few hundred integer operations, but as numpy calls it costs about 20 us
of Python a step on a fast host and several times that in a serving loop, where the
model step between two replays evicts the interpreter's caches. One C call does it in
a microsecond or two over a few cache lines.

The C code is a screen, never the authority: it says "good" only when it wrote exactly
what the Python path writes and every check passed; otherwise the Python path runs and
names the field and the limit. So a missing compiler costs speed, never correctness:
the library is built once per source version into a per-user cache (``cc`` or ``$CC``,
plain C, no Python or torch headers, so it does not depend on the torch build), loaded
with ``ctypes``, and when anything in that fails the planner says so once and keeps the
Python path. ``FORWARD_PLANNER_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from planner.notices import warn_once

SOURCES = ("stage_screen.c", "host_pass.c", "lane_submit.c")
HEADERS = ("twin.h",)
"""Headers every build may include (``-I`` this directory): in every library's hash."""
_HERE = Path(__file__).resolve().parent
_I64 = ctypes.c_int64
_LENGTH_DTYPES = {torch.int32: 0, torch.int64: 1}
TWIN_RECORD = 15
"""int64s per step of a compiled host pass (``R_SIZE`` in ``twin.h``; checked at load)."""
LANE_HEADS = (6, 7, 64)
"""int64s before a submission record's launches, before a launch's parameters, and the most
parameters a launch takes (``S_HEAD``, ``L_HEAD``, ``MAX_PARAMS`` in ``lane_submit.c``)."""
_OWN_SOURCES = tuple(_HERE / source for source in SOURCES)


def enabled() -> bool:
    """Whether the compiled screens may be used (``FORWARD_PLANNER_NATIVE=0``: never)."""
    return os.environ.get("FORWARD_PLANNER_NATIVE", "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built libraries are kept: ``$FORWARD_PLANNER_CACHE``, else the user cache."""
    base = os.environ.get("FORWARD_PLANNER_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forward-planner"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(
    target_dir: Path | None = None,
    *,
    sources: tuple[Path, ...] | None = None,
    name: str = "fp_native",
) -> Path:
    """Compile ``sources`` (default: this package's) into a shared library named by their
    hash; its path. Backends build their own C through this, so every compiled piece shares
    one cache, one switch and one way of failing.

    Built into a temporary file and renamed, so processes starting together (one per
    GPU) never load a half-written library. Raises ``RuntimeError`` with the compiler's
    output when there is no compiler or the build fails.
    """
    paths = sources if sources is not None else _OWN_SOURCES
    headers = tuple(_HERE / header for header in HEADERS)
    text = b"".join(path.read_bytes() for path in (*paths, *headers))
    digest = hashlib.sha256(text).hexdigest()[:16]
    target_dir = target_dir or cache_dir()
    target = target_dir / f"{name}_{digest}.so"
    if target.exists():
        return target
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
    os.close(fd)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-std=c99", f"-I{_HERE}", "-o", tmp]
    cmd += [str(path) for path in paths]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, sources: tuple[Path, ...], what: str) -> ctypes.CDLL | None:
    """Build (once per source version) and load a library; None when disabled, or when the
    build or the load failed, which is said once as ``what`` unavailable."""
    if not enabled():
        return None
    try:
        return ctypes.CDLL(str(build(sources=sources, name=name)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warn_once(f"forward-planner: {what} unavailable, Python path used: {exc}")
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The staging screen's library, or None (disabled, or the build or load failed: said
    once)."""
    lib = load("fp_native", _OWN_SOURCES, "compiled staging screen")
    if lib is None:
        return None
    screen = lib.fp_stage_screen
    screen.restype = ctypes.c_int
    screen.argtypes = [_I64, _I64]
    runner = lib.fp_host_pass
    runner.restype = _I64
    runner.argtypes = [_I64, _I64, _I64]
    lib.fp_twin_record_size.restype = _I64
    lib.fp_twin_record_size.argtypes = []
    lib.fp_max_sum.restype = None
    lib.fp_max_sum.argtypes = [_I64, _I64, _I64, _I64]
    lib.fp_screen_and_pass.restype = _I64
    lib.fp_screen_and_pass.argtypes = [_I64, _I64, _I64, _I64]
    lib.fp_lane_submit.restype = _I64
    lib.fp_lane_submit.argtypes = [_I64] * 6
    for name in ("fp_lane_record_head", "fp_lane_launch_head", "fp_lane_max_params"):
        getattr(lib, name).restype = _I64
        getattr(lib, name).argtypes = []
    return lib


def stage_screen():
    """The C staging screen as a ctypes function, or None: ``fn(host, args)`` with the
    addresses of the int32 staging region and of its packed int64 arguments."""
    lib = library()
    return None if lib is None else lib.fp_stage_screen


@functools.cache
def host_pass_runner():
    """``fp_host_pass(buffer, program, steps)`` as a ctypes function, or None: runs a
    compiled host pass (``planner.host_pass``) in one call. None also where the built
    header's records are not the ones Python writes (said once)."""
    lib = library()
    if lib is None:
        return None
    size = lib.fp_twin_record_size()
    if size != TWIN_RECORD:
        warn_once(
            f"forward-planner: twin.h records are {size} int64s, not {TWIN_RECORD}; numpy used"
        )
        return None
    return lib.fp_host_pass


@functools.cache
def screen_and_pass():
    """``fp_screen_and_pass(host, args, program, steps)`` as a ctypes function, or None:
    the staging screen then a compiled host pass in one call (-1: the screen refused, else
    the pass's answer, 0 when every twin wrote its output). None also where the host pass
    runner is unavailable."""
    lib = library()
    if lib is None or host_pass_runner() is None:
        return None
    return lib.fp_screen_and_pass


@functools.cache
def lane_submit():
    """``fp_lane_submit(record, host, args, device, stream, table)`` as a ctypes function,
    or None: the eager lane's screen, host pass, copy and launches in one call
    (``planner.lane_submit`` packs its record). None also where the built library's record
    layout is not the one Python packs (said once)."""
    lib = library()
    if lib is None or host_pass_runner() is None:
        return None
    heads = (lib.fp_lane_record_head(), lib.fp_lane_launch_head(), lib.fp_lane_max_params())
    if heads != LANE_HEADS:
        warn_once(f"forward-planner: lane_submit.c records are {heads}, not {LANE_HEADS}")
        return None
    return lib.fp_lane_submit


class MaxSum:
    """The longest and the total of a host length tensor in one C call (two numpy
    reductions cost about 10 us each on a GPU host), or None where it cannot say."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._out = (ctypes.c_int64 * 2)()
        self._address = ctypes.addressof(self._out)

    def __call__(self, lengths) -> tuple[int, int] | None:
        """``(max, sum)`` of a contiguous int32 or int64 CPU tensor with at least one value."""
        dtype = lengths.dtype
        if not (lengths.is_cpu and lengths.is_contiguous() and dtype in _LENGTH_DTYPES):
            return None
        n = lengths.shape[0]
        if n == 0:
            return None
        self._fn(lengths.data_ptr(), n, _LENGTH_DTYPES[dtype], self._address)
        return self._out[0], self._out[1]

    def int32(self, address: int, n: int) -> tuple[int, int]:
        """``(max, sum)`` of ``n >= 1`` contiguous int32 host values at ``address``: for a
        caller whose own checks made that certain (``planner.lane_door``)."""
        self._fn(address, n, _LENGTH_DTYPES[torch.int32], self._address)
        return self._out[0], self._out[1]


@functools.cache
def max_sum() -> MaxSum | None:
    """The compiled ``(max, sum)`` of a length tensor, or None without the library."""
    lib = library()
    return None if lib is None else MaxSum(lib.fp_max_sum)


@functools.cache
def twin_library(source: Path) -> ctypes.CDLL | None:
    """A backend's compiled host twins (one C file against ``twin.h``), or None."""
    return load(f"fp_twins_{source.parent.name}", (source,), f"compiled host twins ({source})")


def twin_address(source: Path, symbol: str) -> int | None:
    """The address of the twin ``symbol`` in ``source``'s library, or None without one."""
    lib = twin_library(source)
    if lib is None:
        return None
    try:
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except AttributeError:
        warn_once(f"forward-planner: {source} has no host twin {symbol}; numpy used")
        return None


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def int32_params(*values: object, low: int = _INT32_MIN) -> tuple[int, ...] | None:
    """``values`` for a compiled twin's record when every one is an int in ``[low, int32
    max]``, else None (numpy's ``np.int32(value)`` would raise, or a bound the C assumes
    fails: the numpy twin runs instead)."""
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        if not low <= value <= _INT32_MAX:
            return None
    return tuple(values)  # type: ignore[arg-type]
