#!/usr/bin/env bash
# Download the GPU-side wheels (see shared/DEVICE.md) into .whl/ for the lent H200 machine.
#
# Why: the device image has torch 2.11+cu130 but no deep_gemm, flashinfer or pydantic, and
# cannot reach any registry; newer sgl-deep-gemm builds are compiled against a newer torch
# and fail to load there. These versions are the known-good set. Run it here (network), then
# name `.whl` in the device call's `carry` and start the command with
# `source scripts/device_prelude.sh` (or paste its install line).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p .whl
if [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
    echo '/.whl/' >> .git/info/exclude
fi

P=(--only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)

python3 -m pip download -q "${P[@]}" --no-deps \
    sgl-deep-gemm==0.1.0 apache-tvm-ffi==0.1.11 flashinfer-python==0.5.3 nvidia-cudnn-frontend
python3 -m pip download -q "${P[@]}" pydantic

# Two typing_extensions wheels would both install into one --target: keep the newest.
mapfile -t te < <(ls -1 .whl/typing_extensions-*.whl 2>/dev/null | sort -V)
if [ "${#te[@]}" -gt 1 ]; then
    for f in "${te[@]:0:${#te[@]}-1}"; do rm -f "$f"; done
fi

ls -1 .whl
du -sh .whl
