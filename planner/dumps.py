"""Plan dumps: a batch's frozen plans on disk, to read, compare and keep.

A stale buffer or a bad padding row is found by looking at the exact bytes a
kernel read, often on another machine, long after the process is gone. A dump
keeps them in two inert formats and nothing else:

- ``dump.json``: the index (format version, label, step, which backends, and
  size and hash of every other file, so truncation and corruption are caught);
- ``<backend>.json``: the manifest of one backend's plan: schema name and
  version, phase, mode, step, batch signature, and per field the spec, shape,
  dtype, device, data pointer, checksum, summary statistics and first values;
  the host scalars;
- ``<backend>.safetensors``: the full tensors, copied to the host.

Never pickle: loading parses JSON and safetensors only, so opening a dump
from anywhere executes no code. A dump appears whole or not at all: it is
written into a temporary directory beside its destination, fsynced, and
renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ValidationError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from planner.errors import DumpError
from planner.verify import tensor_digest

if TYPE_CHECKING:
    from planner.batch import ForwardBatch
    from planner.planner import PlanSet

FORMAT = "forward-planner-plan-dump"
FORMAT_VERSION = 1
INDEX = "dump.json"
HEAD = 8
"""Values of each field kept in the manifest, enough to eyeball without the tensors."""

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

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


def _host(tensor: torch.Tensor) -> torch.Tensor:
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


def batch_signature(batch: ForwardBatch, padded_reqs: int) -> BatchSignature:
    """What identifies a batch in a dump without storing the whole batch."""
    lens = batch.seq_lens_cpu.to(torch.int64)
    return BatchSignature(
        bs=batch.bs,
        padded_reqs=padded_reqs,
        next_n=int(batch.next_n),
        mode=getattr(batch.mode, "value", str(batch.mode)),
        seq_lens=SeqLensSummary(
            head=lens[:HEAD].tolist(),
            min=int(lens.min()),
            max=int(lens.max()),
            sum=int(lens.sum()),
        ),
    )


# ---- writing ---------------------------------------------------------------------------------


def _blake2b(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _json_bytes(model: BaseModel) -> bytes:
    return (json.dumps(model.model_dump(mode="json"), indent=1, allow_nan=False) + "\n").encode()


def write_synced(path: Path, data: bytes) -> None:
    """Create ``path`` (never overwrite) and make its bytes durable before it is published."""
    with open(path, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable: a rename is not, until its directory is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _backend_files(
    backend: str,
    plan: Any,
    plans: PlanSet,
    step: int | None,
    label: str,
    signature: BatchSignature | None,
) -> tuple[BackendManifest, bytes]:
    """One backend's manifest and safetensors bytes."""
    fields: dict[str, FieldRecord] = {}
    host: dict[str, torch.Tensor] = {}
    for name, tensor in plan.tensors().items():
        data = _host(tensor)
        host[name] = data
        fields[name] = FieldRecord(
            spec=plan.tensor_specs[name].to_json(),
            shape=list(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            device=str(tensor.device),
            data_ptr=int(tensor.data_ptr()),
            checksum=tensor_digest(data),
            summary=summarize(data),
            head=head_values(data),
        )
    try:
        blob = save_safetensors(host, metadata={"format": FORMAT, "backend": backend})
    except Exception as exc:  # an unsupported dtype, say: name it, do not leak a Rust error
        raise DumpError(
            f"cannot store the tensors of backend {backend!r}: {exc}", field=backend
        ) from None
    cls = type(plan)
    manifest = BackendManifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        backend=backend,
        plan_schema=SchemaInfo(
            name=cls.__name__,
            module=cls.__module__,
            backend=getattr(cls, "backend", "") or backend,
            version=int(getattr(cls, "version", 1)),
        ),
        phase=plans.phase,
        mode=getattr(plans.mode, "value", str(plans.mode)),
        reqs=int(plans.reqs),
        real_reqs=int(plans.real_reqs),
        step=step,
        label=label,
        batch=signature,
        tensors_file=f"{backend}.safetensors",
        fields=fields,
        scalars={k: json_value(v) for k, v in plan.scalars().items()},
    )
    return manifest, blob


def dump_plans(
    plans: PlanSet,
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    batch: ForwardBatch | None = None,
    label: str = "",
) -> Path:
    """Write ``plans`` as a dump at ``directory`` (created) and return its path.

    Atomic: the dump is built in a temporary sibling directory, fsynced and
    renamed into place, so a crash leaves the old dump or the new one, never
    half of one. An existing dump at ``directory`` is replaced; any other
    non-empty directory there is refused rather than deleted.
    """
    target = Path(directory)
    for backend in plans:
        if not _SAFE_NAME.match(backend):
            raise DumpError("backend name unusable as a file name", field=backend)
    signature = batch_signature(batch, int(plans.reqs)) if batch is not None else None
    contents: dict[str, bytes] = {}
    backends: dict[str, BackendFiles] = {}
    for backend, plan in plans.items():
        manifest, blob = _backend_files(backend, plan, plans, step, label, signature)
        contents[f"{backend}.json"] = _json_bytes(manifest)
        contents[manifest.tensors_file] = blob
        backends[backend] = BackendFiles(manifest=f"{backend}.json", tensors=manifest.tensors_file)
    index = DumpIndex(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        label=label,
        step=step,
        backends=backends,
        files={
            name: FileRecord(bytes=len(data), blake2b=_blake2b(data))
            for name, data in contents.items()
        },
    )
    contents[INDEX] = _json_bytes(index)
    try:
        _publish(target, contents)
    except OSError as exc:
        raise DumpError(f"cannot write plan dump {target}: {exc.strerror or exc}") from None
    return target


def _publish(target: Path, contents: Mapping[str, bytes]) -> None:
    """Write files into a fresh sibling directory, then rename it onto ``target``."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = parent / f".{target.name}.tmp-{token}"
    os.mkdir(tmp)  # not mkdtemp: its 0700 mode would outlive the rename
    try:
        for name, data in contents.items():
            write_synced(tmp / name, data)
        fsync_dir(tmp)
        old = None
        if target.exists() and any(target.iterdir()):
            if not (target / INDEX).is_file():
                raise DumpError(f"refusing to replace {target}: it exists and is not a plan dump")
            old = parent / f".{target.name}.old-{token}"
            os.replace(target, old)
        os.replace(tmp, target)  # onto nothing or an empty directory: atomic on POSIX
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- loading ---------------------------------------------------------------------------------


class DumpedPlan:
    """A loaded backend plan that :func:`planner.verify.diff_plans` can compare.

    Loading builds no ``Plan`` subclass (that would mean importing whatever
    module a manifest names); this read-only stand-in has the same surface
    ``diff_plans`` reads: ``tensor_specs``, ``scalar_specs`` and attributes.
    """

    def __init__(
        self,
        manifest: BackendManifest,
        tensors: Mapping[str, torch.Tensor],
        fields: Sequence[str] | None = None,
        scalars: Sequence[str] | None = None,
    ):
        """``fields`` / ``scalars`` restrict the comparison (to those both sides have)."""
        self.backend = manifest.backend
        self.manifest = manifest
        keep = manifest.fields if fields is None else fields
        keep_scalars = manifest.scalars if scalars is None else scalars
        self.tensor_specs = {n: manifest.fields[n] for n in keep}
        self.scalar_specs = {n: manifest.scalars[n] for n in keep_scalars}
        self._values: dict[str, Any] = {**tensors, **manifest.scalars}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self._values[name] for name in self.tensor_specs}

    def scalars(self) -> dict[str, JsonValue]:
        return {name: self._values[name] for name in self.scalar_specs}


@dataclass(frozen=True)
class LoadedDump:
    """A dump read back and checked: manifests, host tensors, and the index."""

    path: Path
    index: DumpIndex
    manifests: dict[str, BackendManifest]
    tensors: dict[str, dict[str, torch.Tensor]]

    @property
    def backends(self) -> list[str]:
        return list(self.manifests)

    def _first(self) -> BackendManifest | None:
        return next(iter(self.manifests.values()), None)

    @property
    def step(self) -> int | None:
        return self.index.step

    @property
    def label(self) -> str:
        return self.index.label

    @property
    def phase(self) -> str:
        first = self._first()
        return first.phase if first else ""

    @property
    def mode(self) -> str:
        first = self._first()
        return first.mode if first else ""

    @property
    def batch(self) -> BatchSignature | None:
        first = self._first()
        return first.batch if first else None

    def scalars(self, backend: str) -> dict[str, JsonValue]:
        return dict(self.manifests[backend].scalars)

    def fields(self) -> Iterator[tuple[str, str, FieldRecord, torch.Tensor]]:
        """``(backend, field, record, tensor)`` for every tensor field, in dump order."""
        for backend, manifest in self.manifests.items():
            for name, record in manifest.fields.items():
                yield backend, name, record, self.tensors[backend][name]

    def plans(self) -> dict[str, DumpedPlan]:
        """Backend -> plan stand-in, for :func:`planner.verify.diff_plans`."""
        return {b: DumpedPlan(m, self.tensors[b]) for b, m in self.manifests.items()}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DumpError(f"plan dump is missing {path}") from None
    except OSError as exc:
        raise DumpError(f"cannot read {path}: {exc.strerror or exc}") from None


def _parse(path: Path, data: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> a validated model; every failure becomes one line naming the file."""
    try:
        raw = json.loads(data)
    except UnicodeDecodeError:
        raise DumpError(f"corrupt plan dump: {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise DumpError(
            f"corrupt or truncated plan dump: {path} is not valid JSON "
            f"({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DumpError(f"not a plan dump: {path} lacks format {FORMAT!r}")
    version = raw.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DumpError(
            f"unsupported plan dump version in {path}",
            expected=f"<= {FORMAT_VERSION}",
            actual=version,
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "top level"
        raise DumpError(f"corrupt plan dump: {path}: {where}: {err['msg']}") from None


def _member(root: Path, name: str) -> Path:
    """A file named by the index, refused if it would leave the dump directory."""
    if not _SAFE_NAME.match(name) or name == INDEX:
        raise DumpError(f"corrupt plan dump: {root / INDEX} names an unsafe file {name!r}")
    return root / name


def _checked(root: Path, index: DumpIndex, name: str) -> bytes:
    """A member's bytes, with its size checked against the index (truncation)."""
    path = _member(root, name)
    data = _read(path)
    record = index.files.get(name)
    if record is None:
        raise DumpError(f"corrupt plan dump: {root / INDEX} lists no size or hash for {name}")
    if len(data) != record.bytes:
        what = "truncated" if len(data) < record.bytes else "corrupt"
        raise DumpError(f"{what} plan dump: {path} has {len(data)} bytes, expected {record.bytes}")
    return data


def _check_hash(root: Path, index: DumpIndex, name: str, data: bytes) -> None:
    if _blake2b(data) != index.files[name].blake2b:
        raise DumpError(f"corrupt plan dump: {root / name} does not match its hash in {INDEX}")


def load_dump(path: str | os.PathLike[str]) -> LoadedDump:
    """Read a dump and check it completely; any defect raises :class:`DumpError`.

    Checks, in order: the index parses; each member has the recorded size
    (truncation); each manifest parses and validates; the safetensors file
    parses and holds exactly the manifest's fields with their shapes and
    dtypes; every tensor's checksum matches (names the field); every file's
    hash matches (corruption anywhere else). Only JSON and safetensors are
    parsed, so loading an untrusted dump runs no code.
    """
    root = Path(path)
    if not root.exists():
        raise DumpError(f"no plan dump at {root}: path does not exist")
    if not root.is_dir():
        raise DumpError(f"no plan dump at {root}: not a directory")
    if not (root / INDEX).is_file():
        hint = ""
        if (root / "replayed" / INDEX).is_file():
            hint = f" (it holds a mismatch: use {root / 'replayed'} or {root / 'eager'})"
        raise DumpError(f"not a plan dump: {root / INDEX} is missing{hint}")
    index: DumpIndex = _parse(root / INDEX, _read(root / INDEX), DumpIndex)
    for files in index.backends.values():  # before reading anything the index names
        _member(root, files.manifest)
        _member(root, files.tensors)
    manifests: dict[str, BackendManifest] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for backend, files in index.backends.items():
        manifest_bytes = _checked(root, index, files.manifest)
        manifest: BackendManifest = _parse(root / files.manifest, manifest_bytes, BackendManifest)
        _check_hash(root, index, files.manifest, manifest_bytes)
        if manifest.backend != backend or manifest.tensors_file != files.tensors:
            raise DumpError(f"corrupt plan dump: {root / files.manifest} disagrees with {INDEX}")
        blob = _checked(root, index, files.tensors)
        tensors[backend] = _load_tensors(root / files.tensors, blob, manifest)
        _check_hash(root, index, files.tensors, blob)
        manifests[backend] = manifest
    return LoadedDump(root, index, manifests, tensors)


def _load_tensors(path: Path, blob: bytes, manifest: BackendManifest) -> dict[str, torch.Tensor]:
    try:
        loaded = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own Rust error type
        raise DumpError(
            f"corrupt or truncated plan dump: {path} is not valid safetensors ({exc})"
        ) from None
    if set(loaded) != set(manifest.fields):
        raise DumpError(
            f"corrupt plan dump: {path} holds other fields than its manifest",
            expected=sorted(manifest.fields),
            actual=sorted(loaded),
        )
    out: dict[str, torch.Tensor] = {}
    for name, record in manifest.fields.items():
        tensor = loaded[name]
        key = f"{manifest.backend}.{name}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        if list(tensor.shape) != record.shape or dtype != record.dtype:
            raise DumpError(
                f"corrupt plan dump: {path}: field {name} does not match its manifest",
                field=key,
                expected=(record.shape, record.dtype),
                actual=(list(tensor.shape), dtype),
            )
        digest = tensor_digest(tensor)
        if digest != record.checksum:
            raise DumpError(
                f"corrupt plan dump: checksum mismatch for field {name} in {path}",
                field=key,
                expected=record.checksum,
                actual=digest,
            )
        out[name] = tensor
    return out
