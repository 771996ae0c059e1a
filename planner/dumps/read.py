"""Reading a plan dump back, checked completely: size, hash, schema and checksum of every part.

Only JSON and safetensors are parsed, so opening a dump from anywhere runs no code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError
from safetensors.torch import load as load_safetensors

from planner.debug import tensor_digest
from planner.dumps.format import (
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    SAFE_NAME,
    BackendManifest,
    BatchSignature,
    DumpIndex,
    FieldRecord,
    JsonValue,
)
from planner.dumps.write import blake2b
from planner.errors import DumpError


class DumpedPlan:
    """A loaded backend plan that :func:`planner.debug.diff_plans` can compare.

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
        """Backend -> plan stand-in, for :func:`planner.debug.diff_plans`."""
        return {b: DumpedPlan(m, self.tensors[b]) for b, m in self.manifests.items()}


def as_loaded(dump: LoadedDump | str | os.PathLike[str]) -> LoadedDump:
    """A loaded dump as it is, or a path loaded (and checked) by :func:`load_dump`."""
    return dump if isinstance(dump, LoadedDump) else load_dump(dump)


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
    if not SAFE_NAME.match(name) or name == INDEX:
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
    if blake2b(data) != index.files[name].blake2b:
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
