"""Plan dumps as text: the cell formats and the console that ``inspect`` and ``diff`` share.

A dump is read by eye on a terminal or by a script through a pipe; both get the same
cells (shapes as tuples, summaries, heads, the batch line, a dump's title), and piped
output is not wrapped at 80 columns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TextIO

import torch
from rich.console import Console

from planner.dumps.format import FieldRecord, json_value
from planner.dumps.read import LoadedDump


def make_console(out: TextIO) -> Console:
    """A console that does not wrap piped output at 80 columns (it is read by scripts)."""
    wide = out.isatty() or "COLUMNS" in os.environ
    return Console(file=out, width=None if wide else 200, highlight=False, markup=False)


def json_tree(value: Any) -> Any:
    """Nested lists from ``tolist()`` with non-finite floats made strict JSON."""
    if isinstance(value, list):
        return [json_tree(v) for v in value]
    return json_value(value)


def tensor_values(tensor: torch.Tensor) -> Any:
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    return json_tree(tensor.tolist())


def fmt_value(value: Any) -> str:
    return "-" if value is None else str(value)


def summary_text(record: FieldRecord) -> str:
    s = record.summary
    parts = [
        f"min {fmt_value(s.min)}",
        f"max {fmt_value(s.max)}",
        f"sum {fmt_value(s.sum)}",
        f"nz {s.nonzero}/{s.count}",
    ]
    if s.nan is not None:
        parts.append(f"nan {s.nan}")
    return "  ".join(parts)


def head_text(record: FieldRecord) -> str:
    more = ", ..." if record.summary.count > len(record.head) else ""
    return "[" + ", ".join(str(v) for v in record.head) + more + "]"


def shape_text(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(str(d) for d in shape) + ")"


def batch_text(dump: LoadedDump) -> str:
    batch = dump.batch
    if batch is None:
        return "batch: not recorded"
    s = batch.seq_lens
    text = (
        f"batch: {batch.mode}, bs {batch.bs}, padded to {batch.padded_reqs}, next_n {batch.next_n}, "
        f"seq_lens min {s.min} max {s.max} sum {s.sum} head {s.head}"
    )
    e = batch.extend_lens
    if e is not None:
        text += f"; extend_lens min {e.min} max {e.max} sum {e.sum} (tokens) head {e.head}"
    return text


def dump_title(dump: LoadedDump) -> str:
    step = "-" if dump.step is None else dump.step
    label = f" '{dump.label}'" if dump.label else ""
    return f"{dump.path}{label}: step {step}, phase {dump.phase}, mode {dump.mode}"
