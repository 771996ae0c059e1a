"""Debug mode and comparison: prove that replayed plans equal fresh ones, and that layers
only read them.

Off by default (``PLANNER_DEBUG=1`` or ``debug=True`` turns it on), because both checks copy
plans to the host. :func:`check_replay` compares a replayed plan set, as the production
replay path left it, with an eager plan of the same padded batch, bit for bit, and the
padding rows with the schemas' pad values; :func:`guard` digests plans around a forward. A
mismatch is handed to the planner's declared ``on_mismatch`` hook (dumps use it) before the
error is raised. Bit-equality, not closeness: metadata is integers, and a replayed plan
that differs from a fresh eager one in a single element is a stale buffer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from planner.batch import base_backend
from planner.errors import ConfigError, PlanWriteError, ReplayError
from planner.schema import Plan

if TYPE_CHECKING:
    from planner.batch import ForwardBatch
    from planner.plans import PlannerStats, PlanSet

MismatchHook = Callable[["ForwardBatch", "PlanSet", "PlanSet"], None]
"""``on_mismatch(batch, replayed, eager)``: called before a mismatch is raised."""

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}


def debug_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``PLANNER_DEBUG`` (of ``environ``, else the process's): a misspelt value must not
    silently leave the checks off. A CLI checks it up front with its own ``environ`` copy."""
    env = os.environ if environ is None else environ
    value = env.get("PLANNER_DEBUG", "").strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ConfigError(
        "not a boolean",
        field="PLANNER_DEBUG",
        expected="1/true/yes/on or 0/false/no/off",
        actual=value,
    )


def check_replay(
    batch: ForwardBatch,
    replayed: PlanSet,
    eager: PlanSet,
    pads: Mapping[tuple[str, str], object],
    real: dict[str, int],
    on_mismatch: MismatchHook | None,
) -> None:
    """Raise ``ReplayError`` unless ``replayed`` equals ``eager`` and its padding holds the pads."""
    mismatches = diff_plans(replayed, eager)
    bad_pad = padding_violations(replayed, pads, real)
    if not mismatches and not bad_pad:
        return
    if on_mismatch is not None:
        on_mismatch(batch, replayed, eager)
    detail = "; ".join(
        [m.describe() for m in mismatches]
        + [f"{k}: padding rows hold wrong values" for k in bad_pad]
    )
    first = mismatches[0].backend + "." + mismatches[0].field if mismatches else bad_pad[0]
    raise ReplayError(
        f"replayed plan differs from eager (stale buffer, or a layer wrote into it): {detail}",
        field=first,
    )


@contextmanager
def guard(
    plans: Mapping[str, Plan], enabled: bool, stats: PlannerStats | None = None
) -> Iterator[None]:
    """Digest plans before and after the forward; a layer that wrote raises ``PlanWriteError``
    (a check that passed counts in ``stats.write_checks``, for the run's summary).

    The always-on check is ``graphs.plan_writes`` (torch's count of in-place writes, no
    copies); this one compares contents, so it also sees writes torch does not count:
    Triton and other raw-pointer kernels, ``.numpy()`` and ``.data`` writes."""
    if not enabled:
        yield
        return
    before = plan_digests(plans)
    yield
    after = plan_digests(plans)
    changed = sorted(k for k in before if before[k] != after[k])
    if changed:
        raise PlanWriteError(
            "a layer wrote into a plan it may only read", field=changed[0], actual=changed
        )
    if stats is not None:
        stats.write_checks += 1


@dataclass(frozen=True)
class FieldMismatch:
    """How one field of two plans differs."""

    backend: str
    field: str
    reason: str
    indices: list[list[int]]
    left: list
    right: list

    def describe(self) -> str:
        where = ", ".join(str(tuple(i)) for i in self.indices[:5])
        return f"{self.backend}.{self.field}: {self.reason}" + (f" at {where}" if where else "")


def tensor_digest(tensor: torch.Tensor) -> str:
    """A content hash of a tensor (shape, dtype and bytes); copies to the host."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tuple(data.shape)}|{data.dtype}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def plan_digests(plans: Mapping[str, Plan]) -> dict[str, str]:
    """Digest of every tensor field of every plan, keyed ``backend.field``."""
    return {
        f"{backend}.{name}": tensor_digest(tensor)
        for backend, plan in plans.items()
        for name, tensor in plan.tensors().items()
    }


def diff_tensors(
    backend: str, field: str, left: torch.Tensor, right: torch.Tensor
) -> FieldMismatch | None:
    """None when bit-equal, else what differs and where (first indices)."""
    if left.shape != right.shape:
        return FieldMismatch(
            backend, field, f"shape {tuple(left.shape)} != {tuple(right.shape)}", [], [], []
        )
    if left.dtype != right.dtype:
        return FieldMismatch(backend, field, f"dtype {left.dtype} != {right.dtype}", [], [], [])
    a, b = left.detach().cpu(), right.detach().cpu()
    if a.is_floating_point():
        differs = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    else:
        differs = a != b
    if not bool(differs.any()):
        return None
    idx = differs.nonzero()[:16]
    count = int(differs.sum())
    return FieldMismatch(
        backend,
        field,
        f"{count} of {a.numel()} elements differ",
        idx.tolist(),
        [a[tuple(i)].item() for i in idx],
        [b[tuple(i)].item() for i in idx],
    )


def diff_plans(left: Mapping[str, Plan], right: Mapping[str, Plan]) -> list[FieldMismatch]:
    """Every field (tensors and scalars) that differs between two plan sets."""
    out: list[FieldMismatch] = []
    for backend in sorted(set(left) | set(right)):
        if backend not in left or backend not in right:
            out.append(FieldMismatch(backend, "*", "backend missing on one side", [], [], []))
            continue
        lp, rp = left[backend], right[backend]
        for name in lp.tensor_specs:
            mismatch = diff_tensors(backend, name, getattr(lp, name), getattr(rp, name))
            if mismatch is not None:
                out.append(mismatch)
        for name in lp.scalar_specs:
            if getattr(lp, name) != getattr(rp, name):
                out.append(
                    FieldMismatch(
                        backend,
                        name,
                        "scalar differs",
                        [],
                        [getattr(lp, name)],
                        [getattr(rp, name)],
                    )
                )
    return out


def padding_violations(
    plans: Mapping[str, Plan], pads: Mapping[tuple[str, str], object], real: dict[str, int]
) -> list[str]:
    """Fields with a constant pad whose padding rows hold something else.

    ``real`` gives the number of real leading rows per batch dimension
    (``{"reqs": 3, "rows": 6}``; ``tokens`` defaults to the rows, ``kernel_reqs``
    to the rows over the plan's ``kernel_next_n``). A schema's ``row_mask``
    field marks padding rows inside real requests too (draft extend): those
    must hold the pads as well. A stepped plan set's ``backend@s`` plans are
    checked against their backend's pads.
    """
    bad = []
    for key, plan in plans.items():
        backend = base_backend(key)
        mask = _padding_rows(plan, real)
        for name, spec in plan.tensor_specs.items():
            pad = pads.get((backend, name))
            if pad is None or spec.row_dim is None:
                continue
            tensor = getattr(plan, name)
            n = _real_count(plan, spec.row_dim, real)
            tail = tensor[n:]
            if tail.numel() and not bool((tail == pad).all()):
                bad.append(f"{key}.{name}")
            elif mask is not None and spec.row_dim == "rows":
                inside = tensor[: mask.shape[0]][mask]
                if inside.numel() and not bool((inside == pad).all()):
                    bad.append(f"{key}.{name}")
    return bad


def _real_count(plan: Plan, dim: str, real: Mapping[str, int]) -> int:
    if dim in real:
        return real[dim]
    if dim == "kernel_reqs":
        return real["rows"] // int(getattr(plan, "kernel_next_n", 1))
    return real["rows"] if dim == "tokens" else real[dim]


def _padding_rows(plan: Plan, real: Mapping[str, int]) -> torch.Tensor | None:
    """Which of the real requests' rows are padding, by the schema's ``row_mask`` field."""
    name = type(plan).row_mask
    if name is None:
        return None
    return getattr(plan, name)[: real["rows"]] == 0
