"""Lazy access to the real ``deep_gemm`` (sgl-deep-gemm) package.

Importing ``deep_gemm`` loads a CUDA extension: it fails on CPU-only machines, and on a
mismatched torch it fails with an undefined-symbol ``OSError`` rather than ``ImportError``.
So the import happens on first use only, any failure is remembered (a failed import is not
retried on every batch) and reported once with ``warnings.warn``; callers then use the
PyTorch references.

The schedule layout of the installed build is read from the CUDA header it ships (the
metadata kernel is JIT-compiled from that header), without importing the extension.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import warnings
from types import ModuleType

import torch

from planner.errors import PlanError, ProviderError

__all__ = [
    "arch_major",
    "available",
    "kernel_module",
    "load",
    "native_schedule_layout",
    "reset",
    "validate_backend",
]

BACKENDS = ("auto", "native", "reference")

_MODULE: ModuleType | None = None
_FAILED: str | None = None
_LAYOUT_CACHE: dict[str, str | None] = {}

_SCHED_HEADER = os.path.join("include", "deep_gemm", "scheduler", "paged_mqa_logits.cuh")
# Older trees kept the metadata kernel next to the logits kernel.
_OLD_HEADER = os.path.join("include", "deep_gemm", "impls", "sm90_fp8_paged_mqa_logits.cuh")


def load() -> ModuleType | None:
    """Return the imported ``deep_gemm`` module, or ``None`` if it cannot be imported.

    The first failure is warned about once and remembered for the life of the process.
    """
    global _MODULE, _FAILED
    if _MODULE is not None:
        return _MODULE
    if _FAILED is not None:
        return None
    try:
        _MODULE = importlib.import_module("deep_gemm")
    except Exception as exc:  # ImportError, OSError (undefined symbol), AssertionError (no CUDA)
        _FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"deep_gemm is unavailable ({_FAILED}); using the PyTorch references",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _MODULE


def validate_backend(backend: object) -> None:
    """The ``backend=`` choice every drop-in API function takes."""
    if backend not in BACKENDS:
        raise PlanError("unknown backend", field="backend", expected=BACKENDS, actual=backend)


def kernel_module(backend: object, tensor: torch.Tensor) -> ModuleType | None:
    """The ``deep_gemm`` module a drop-in call with ``backend=`` over ``tensor`` runs on, or
    None for the reference; ``"native"`` that cannot be honoured is a ``ProviderError``."""
    validate_backend(backend)
    if backend == "reference":
        return None
    if not tensor.is_cuda:
        if backend == "native":
            raise ProviderError(
                "the real kernel needs CUDA tensors",
                field="backend",
                expected="cuda",
                actual=tensor.device,
            )
        return None
    dg = load()
    if dg is None and backend == "native":
        raise ProviderError(
            "deep_gemm does not import", field="backend", expected="deep_gemm", actual="unavailable"
        )
    return dg


def arch_major(tensor: torch.Tensor) -> int:
    """Compute capability major of the GPU holding ``tensor`` (9 Hopper, 10 Blackwell): the
    number deep_gemm 0.1.0's host code dispatches on."""
    return torch.cuda.get_device_capability(tensor.device)[0]


def available() -> bool:
    """True when ``deep_gemm`` imports (attempting the import once)."""
    return load() is not None


def _package_dir() -> str | None:
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def classify_schedule_header(text: str) -> str | None:
    """Which remainder rule a metadata-kernel source uses: ``"0.1.0"``, ``"new"`` or None.

    The non-varlen branch is the last ``seg_starts = sm_idx * q ...`` assignment in the file.
    0.1.0 gives the remainder to the first SMs (``min(sm_idx, r)``); newer builds to the last
    SMs (a ``pivot = kNumSMs - r``).
    """
    lines = re.findall(r"seg_starts\s*=\s*sm_idx\s*\*\s*q\s*\+[^;]*;", text)
    if not lines:
        return None
    last = lines[-1]
    if "pivot" in last:
        return "new"
    if re.search(r"min\(\s*sm_idx\s*,\s*r\s*\)", last):
        return "0.1.0"
    return None


def native_schedule_layout() -> str | None:
    """Schedule layout of the installed deep_gemm build, from its shipped header.

    Returns ``"0.1.0"`` (remainder splits on the first SMs), ``"new"`` (on the last SMs) or
    ``None`` when deep_gemm is not installed or the header is not recognised.
    """
    if "layout" in _LAYOUT_CACHE:
        return _LAYOUT_CACHE["layout"]
    layout: str | None = None
    pkg = _package_dir()
    if pkg is not None:
        for rel in (_SCHED_HEADER, _OLD_HEADER):
            path = os.path.join(pkg, rel)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    layout = classify_schedule_header(fh.read())
                break
    _LAYOUT_CACHE["layout"] = layout
    return layout


def reset() -> None:
    """Forget the cached import result and layout (for tests)."""
    global _MODULE, _FAILED
    _MODULE = None
    _FAILED = None
    _LAYOUT_CACHE.clear()
