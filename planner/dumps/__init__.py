"""Plan dumps: a batch's frozen plans on disk, to read, inspect, compare and keep.

A stale buffer or a bad padding row is found by looking at the exact bytes a
kernel read, often on another machine, long after the process is gone. An engine
that plans with the library dumps and reads its plans with the library alone::

    from planner.dumps import dump_plans, print_diff, print_dump
    path = dump_plans(plans, "dumps/step-7", step=7, batch=batch)  # JSON + safetensors
    print_dump(path)  # the table `python -m planner inspect` prints

``format`` defines the files, ``write`` makes a dump atomically, ``read`` loads
one back and checks every byte of it, ``inspect`` and ``diff`` show one dump or
what differs between two (``python -m planner inspect`` / ``diff`` are thin
wrappers over them), ``text`` holds the cell formats they share.
"""

from planner.dumps.diff import (
    FieldDiff,
    diff_dumps,
    diff_report,
    differing,
    print_diff,
    render_diff,
)
from planner.dumps.format import (
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
from planner.dumps.inspect import inspect_report, print_dump, render_dump, select_fields
from planner.dumps.read import DumpedPlan, LoadedDump, as_loaded, load_dump
from planner.dumps.text import make_console
from planner.dumps.write import dump_plans, fsync_dir, write_synced

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HEAD",
    "INDEX",
    "BackendManifest",
    "BatchSignature",
    "DumpIndex",
    "DumpedPlan",
    "FieldDiff",
    "FieldRecord",
    "LoadedDump",
    "as_loaded",
    "batch_signature",
    "diff_dumps",
    "diff_report",
    "differing",
    "dump_plans",
    "fsync_dir",
    "inspect_report",
    "json_value",
    "load_dump",
    "make_console",
    "print_diff",
    "print_dump",
    "render_diff",
    "render_dump",
    "select_fields",
    "summarize",
    "write_synced",
]
