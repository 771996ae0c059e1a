"""Writing a plan dump: whole or not at all.

A dump is written into a temporary directory beside its destination,
fsynced, and renamed into place, so a crash leaves the old dump or the new
one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel
from safetensors.torch import save as save_safetensors

from planner.debug import tensor_digest
from planner.dumps.format import (
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    SAFE_NAME,
    BackendFiles,
    BackendManifest,
    BatchSignature,
    DumpIndex,
    FieldRecord,
    FileRecord,
    SchemaInfo,
    batch_signature,
    head_values,
    host_copy,
    json_value,
    summarize,
)
from planner.errors import DumpError

if TYPE_CHECKING:
    from planner.batch import ForwardBatch
    from planner.plans import PlanSet


def blake2b(data: bytes) -> str:
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
        data = host_copy(tensor)
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
        if not SAFE_NAME.match(backend):
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
            name: FileRecord(bytes=len(data), blake2b=blake2b(data))
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
