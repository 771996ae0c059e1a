#!/usr/bin/env bash
# The install line every device (H200) command starts with; see shared/DEVICE.md.
#
# Sourced on the device, it installs the carried wheels (.whl/, from
# scripts/fetch_gpu_wheels.sh; name `.whl` in the run's `carry`) into /tmp/site, quietly,
# and puts the work tree and /tmp/site on PYTHONPATH:
#     source scripts/device_prelude.sh || exit 1; python3 -m benchmarks deepgemm ...
# Executed instead, it prints that install line and nothing else, for pasting:
#     echo "$(bash scripts/device_prelude.sh) python3 ..."
LINE='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit 1;'

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    printf '%s\n' "$LINE"
    exit 0
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
# Silent on success; on failure pip's own message goes to stderr.
_dp_log="$(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl 2>&1)" || { printf '%s\n' "$_dp_log" >&2; return 1; }
unset _dp_log
# The backends register through entry points (pyproject.toml); a work tree on PYTHONPATH has
# no installed metadata, so write the entry points where importlib.metadata finds them.
python3 - <<'PY' || return 1
import pathlib, tomllib
eps = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["entry-points"]
info = pathlib.Path("/tmp/site/forward_planner-0.0.dist-info")
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: forward-planner\nVersion: 0.0\n")
(info / "entry_points.txt").write_text(
    "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) for group, items in eps.items())
)
PY
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
