"""The plan dump format: its constants, the pydantic models of its JSON files, and summaries.

A dump keeps a batch's plans in two inert formats and nothing else:

- ``dump.json``: the index (format version, label, step, which backends, and
  size and hash of every other file, so truncation and corruption are caught);
- ``<backend>.json``: the manifest of one backend's plan: schema name and
  version, phase, mode, step, batch signature, and per field the spec, shape,
  dtype, device, data pointer, checksum, summary statistics and first values;
  the host scalars;
- ``<backend>.safetensors``: the full tensors, copied to the host.

Never pickle: loading parses JSON and safetensors only.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel

if TYPE_CHECKING:
    from planner.batch import ForwardBatch

FORMAT = "forward-planner-plan-dump"
FORMAT_VERSION = 1
INDEX = "dump.json"
HEAD = 8
"""Values of each field kept in the manifest, enough to eyeball without the tensors."""

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*$")
"""Backend names a dump writes files under (``nsa@2``: step 2 of a stepped plan set)."""

JsonValue = bool | int | float | str | None
"""A head value or statistic: non-finite floats are stored as "nan", "inf", "-inf"."""


# ---- the on-disk models ----------------------------------------------------------------------


class SeqLensSummary(BaseModel):
    """The batch's KV lengths, summarised: enough to tell two batches apart."""

    head: list[int]
    min: int
    max: int
    sum: int


class BatchSignature(BaseModel):
    """What the plans were made for: requests, padded size, tokens per request, lengths."""

    bs: int
    padded_reqs: int
    next_n: int
    mode: str
    seq_lens: SeqLensSummary
    extend_lens: SeqLensSummary | None = None
    """Tokens each request added (extend and mixed batches; absent when uniform)."""


class Summary(BaseModel):
    """Statistics of a field; floats ignore NaNs in min/max/sum and count them apart."""

    count: int
    nonzero: int
    min: JsonValue = None
    max: JsonValue = None
    sum: JsonValue = None
    nan: int | None = None


class FieldRecord(BaseModel):
    """One tensor field as the kernels saw it."""

    spec: dict[str, Any]
    shape: list[int]
    dtype: str
    device: str
    data_ptr: int
    checksum: str
    summary: Summary
    head: list[JsonValue]


class SchemaInfo(BaseModel):
    """The plan schema a manifest was written from (informative: loading never imports it)."""

    name: str
    module: str
    backend: str
    version: int


class BackendManifest(BaseModel):
    """The JSON half of one backend's dump."""

    format: Literal["forward-planner-plan-dump"]
    format_version: int
    backend: str
    plan_schema: SchemaInfo
    phase: str
    mode: str
    reqs: int
    real_reqs: int
    step: int | None
    label: str
    batch: BatchSignature | None
    tensors_file: str
    fields: dict[str, FieldRecord]
    scalars: dict[str, JsonValue]


class FileRecord(BaseModel):
    """Size and hash of one file of a dump: what tells truncation from corruption."""

    bytes: int
    blake2b: str


class BackendFiles(BaseModel):
    manifest: str
    tensors: str


class DumpIndex(BaseModel):
    """``dump.json``: what the dump holds and how to check it."""

    format: Literal["forward-planner-plan-dump"]
    format_version: int
    created: str
    label: str
    step: int | None
    backends: dict[str, BackendFiles]
    files: dict[str, FileRecord]


# ---- summaries -------------------------------------------------------------------------------


def json_value(value: Any) -> JsonValue:
    """A Python scalar as strict JSON: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A private, contiguous host copy: never a view sharing storage with another field."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def summarize(tensor: torch.Tensor) -> Summary:
    """Count, nonzeros, min/max/sum (and NaNs for floats) of a host tensor."""
    count = tensor.numel()
    if count == 0:
        return Summary(count=0, nonzero=0, nan=0 if tensor.is_floating_point() else None)
    if tensor.is_floating_point():
        values = tensor.to(torch.float64)
        nans = torch.isnan(values)
        kept = values[~nans]
        nonzero = int(torch.count_nonzero(values))
        if kept.numel() == 0:
            return Summary(count=count, nonzero=nonzero, nan=int(nans.sum()))
        return Summary(
            count=count,
            nonzero=nonzero,
            min=json_value(kept.min().item()),
            max=json_value(kept.max().item()),
            sum=json_value(kept.sum().item()),
            nan=int(nans.sum()),
        )
    values = tensor.to(torch.int64)
    return Summary(
        count=count,
        nonzero=int(torch.count_nonzero(values)),
        min=int(values.min()),
        max=int(values.max()),
        sum=int(values.sum()),
    )


def head_values(tensor: torch.Tensor, n: int = HEAD) -> list[JsonValue]:
    """The first ``n`` elements in row-major order, as JSON values."""
    flat = tensor.reshape(-1)[:n]
    if flat.is_floating_point():
        flat = flat.to(torch.float64)
    return [json_value(v) for v in flat.tolist()]


def _lens_summary(lens: torch.Tensor) -> SeqLensSummary:
    lens = lens.to(torch.int64)
    if lens.numel() == 0:  # an idle batch
        return SeqLensSummary(head=[], min=0, max=0, sum=0)
    return SeqLensSummary(
        head=lens[:HEAD].tolist(), min=int(lens.min()), max=int(lens.max()), sum=int(lens.sum())
    )


def batch_signature(batch: ForwardBatch, padded_reqs: int) -> BatchSignature:
    """What identifies a batch in a dump without storing the whole batch."""
    extend = batch.extend_lens_cpu
    return BatchSignature(
        bs=batch.bs,
        padded_reqs=padded_reqs,
        next_n=int(batch.next_n),
        mode=getattr(batch.mode, "value", str(batch.mode)),
        seq_lens=_lens_summary(batch.seq_lens_cpu),
        extend_lens=None if extend is None else _lens_summary(extend),
    )
