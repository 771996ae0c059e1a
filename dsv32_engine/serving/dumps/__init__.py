"""Plan dumps: a batch's frozen plans on disk, to read, compare and keep.

A stale buffer or a bad padding row is found by looking at the exact bytes a
kernel read, often on another machine, long after the process is gone.
``format`` defines the files, ``write`` makes a dump atomically, ``read``
loads one back and checks every byte of it.
"""

from dsv32_engine.serving.dumps.format import (
    FORMAT,
    FORMAT_VERSION,
    HEAD,
    INDEX,
    BackendManifest,
    BatchSignature,
    DumpIndex,
    FieldRecord,
    batch_signature,
    json_value,
    summarize,
)
from dsv32_engine.serving.dumps.read import DumpedPlan, LoadedDump, load_dump
from dsv32_engine.serving.dumps.write import dump_plans, fsync_dir, write_synced

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HEAD",
    "INDEX",
    "BackendManifest",
    "BatchSignature",
    "DumpIndex",
    "DumpedPlan",
    "FieldRecord",
    "LoadedDump",
    "batch_signature",
    "dump_plans",
    "fsync_dir",
    "json_value",
    "load_dump",
    "summarize",
    "write_synced",
]
