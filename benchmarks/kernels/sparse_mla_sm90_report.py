#!/usr/bin/env python3
"""Compile the sparse MLA attention kernel for sm_90 on any machine and report its resources.

Device time is short and a config that spills or overflows shared memory shows it at
compile time, so this runs here, without a GPU: Triton compiles for a named target
(``GPUTarget("cuda", 90, 32)``) with its bundled ptxas, and its bundled cuobjdump reads
the cubin. Per config of ``CONFIGS`` (split and direct variants, at the real shape):
registers, stack (spill) bytes, shared memory, and in the KV loop the instructions a
thread issues per step, local-memory loads (spills), HGMMA (Hopper tensor cores; HMMA
would be the older path) and LDGSTS (cp.async gathers).

    python -m benchmarks sparse_mla_sm90_report [--heads 128] [--json out.json]

The installed Triton may differ from the device's (3.6.0): treat the numbers as leads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backends.nsa import sparse_mla_triton as kernels
from backends.nsa.sparse_mla_plan import CONFIGS, SparseMLAConfig, head_blocks

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {
    "q_ptr": "*bf16",
    "qr_ptr": "*bf16",
    "kv_ptr": "*bf16",
    "slots_ptr": "*i32",
    "plan_ptr": "*i32",
    "out_ptr": "*bf16",
    "ws_o_ptr": "*fp32",
    "ws_lse_ptr": "*fp32",
}
LOOP_OPS = {
    "LDL": r"\bLDL\b",
    "STL": r"\bSTL\b",
    "HGMMA": r"\bHGMMA\b",
    "HMMA": r"\bHMMA\b",
    "LDGSTS": r"\bLDGSTS\b",
}


def compile_attend(cfg: SparseMLAConfig, heads: int, direct: bool) -> object:
    fn = triton.jit(kernels._attend_kernel)
    sig = {}
    for name in fn.arg_names:
        if name in POINTERS:
            sig[name] = POINTERS[name]
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    block_h = min(cfg.block_h, max(16, 1 << (heads - 1).bit_length()))
    constants = {
        "HEADS": heads,
        "LATENT": 512,
        "ROPE": 64,
        "BLOCK_H": block_h,
        "BLOCK_N": cfg.block_n,
        "HEAD_BLOCKS": head_blocks(heads, block_h),
        "DIRECT": direct,
        "LAZY_RESCALE": cfg.lazy_rescale,
        "DOT_F32": False,
        "RTNE_BF16": False,
    }
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in POINTERS}
    src = ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _addr(line: str) -> int | None:
    m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
    return int(m.group(1), 16) if m else None


def loop_profile(sass: str) -> dict:
    """Instruction counts inside the innermost backward branch (the KV loop)."""
    lines = sass.splitlines()
    best = None
    for line in lines:
        m, here = re.search(r"BRA (0x[0-9a-f]+)", line), _addr(line)
        if m and here is not None and int(m.group(1), 16) < here:
            lo = int(m.group(1), 16)
            if best is None or here - lo > best[1] - best[0]:
                best = (lo, here)
    if best is None:
        return {}
    body = [x for x in lines if (a := _addr(x)) is not None and best[0] <= a <= best[1]]
    body = [x for x in body if re.search(r"\S+\s*;", x)]
    out = {"instructions": len(body)}
    out.update({k: sum(1 for x in body if re.search(p, x)) for k, p in LOOP_OPS.items()})
    return out


def report(cfg: SparseMLAConfig, heads: int, direct: bool) -> dict:
    kernel = compile_attend(cfg, heads, direct)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [TOOLS / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [TOOLS / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True
        ).stdout
    field = lambda key: int(m.group(1)) if (m := re.search(rf"{key}:(\d+)", usage)) else None  # noqa: E731
    loop = loop_profile(sass)
    per_key = loop.get("instructions", 0) / cfg.block_n
    return {
        "config": vars(cfg),
        "direct": direct,
        "registers": field("REG"),
        "stack_bytes": field("STACK"),
        "shared_bytes": kernel.metadata.shared,
        "loop": loop,
        "instructions_per_key": round(per_key, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--json", help="write the rows here")
    p.add_argument(
        "--configs", type=int, help="only the first N configs (a quick check; default: all)"
    )
    args = p.parse_args(argv)
    if args.configs is not None and args.configs < 1:
        p.error(f"--configs must be >= 1, got {args.configs}")
    rows = []
    for cfg in CONFIGS[: args.configs]:
        for direct in (False, True):
            try:
                r = report(cfg, args.heads, direct)
            except Exception as e:  # a config that does not compile: say why, go on
                r = {"config": vars(cfg), "direct": direct, "error": f"{type(e).__name__}: {e}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
