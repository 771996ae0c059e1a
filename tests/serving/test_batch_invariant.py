"""The batch-invariant mode, end to end on the CPU: the key, the flag, the plans, the claims.

The CPU model accumulates every contraction in float64 (``models/layers/exact.py``), so it is
batch-invariant in both modes; what the CPU can show of the mode is that it is wired
(the flag sets the key, the engine plans a fixed split count per row and decode-shaped
verify rows, and sets the model's mode), that what it cannot make invariant is refused by
name, and that the benchmark of its claims runs and finds every claim held. The GPU half
(fixed-tile GEMMs, the split schedule in bf16) is in ``tests/gpu``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.loop import batch_invariance
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.plan_setup import INVARIANT_MLA_SPLITS
from dsv32_engine.serving.run_config import load_run_config
from planner import ForwardMode
from planner.errors import ConfigError
from tests.support import TINY_YAML
from tests.support.cli import planner_cli

SMALL = {"loop.requests": 3, "loop.max_new_tokens": [4, 8], "planner.max_batch": 4}


@pytest.mark.parametrize("invariant", [False, True])
def test_the_key_plans_fixed_splits_and_decode_shaped_verify_rows(invariant):
    overrides = {**SMALL, "planner.batch_invariant": invariant, "speculative.draft": "ngram"}
    engine = DecodeEngine(load_run_config(TINY_YAML, overrides))
    nsa = engine.planner.options["nsa"]
    if invariant:
        assert nsa["mla_fixed_splits"] == INVARIANT_MLA_SPLITS
        assert tuple(nsa["native_next_n"]) == ()
    else:
        assert "mla_fixed_splits" not in nsa and "native_next_n" not in nsa
    assert engine.model.batch_invariant is invariant
    assert engine.speculation.mtp is None  # n-gram: no draft model to set
    if invariant:  # every verify and decode plan's split count, whatever the batch
        splits = {
            engine.planner.dims(mode, bs, 128)["mla_splits"]
            for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
            for bs in (1, 2, 4)
        }
        assert splits == {INVARIANT_MLA_SPLITS}


def test_the_mtp_draft_follows_the_mode():
    overrides = {**SMALL, "planner.batch_invariant": True, "speculative.draft": "mtp"}
    engine = DecodeEngine(load_run_config(TINY_YAML, overrides))
    assert engine.speculation.mtp.batch_invariant is True


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"planner.mla_kernel": "flashinfer"}, "planner.mla_kernel"),
        ({"device": "cuda", "distributed.tp": 2}, "distributed.tp"),
        ({"device": "cuda", "planner.mla_kernel": "torch"}, "planner.mla_kernel"),
    ],
)
def test_what_the_mode_cannot_make_invariant_is_refused_by_name(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_run_config(TINY_YAML, {"planner.batch_invariant": True, **overrides})
    assert info.value.field == field


def test_the_flag_sets_the_key_and_the_summary_says_so(tmp_path):
    out = tmp_path / "run.json"
    done = planner_cli(
        "decode", "--quiet", "--requests", "3", "--batch-invariant", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "batch-invariant" in done.stdout
    assert json.loads(out.read_text())["summary"]["batch_invariant"] is True


def test_the_claims_hold_on_the_cpu_in_both_modes(tmp_path, capsys):
    """The benchmark's smoke run: speculative greedy equals plain greedy at 2 and 4 draft
    tokens (n-gram and MTP), one request's logits are bit-identical alone and among 2 and 8
    others (decode and verify), chunked prefill equals the whole prompt; float32 CPU. The
    speed part runs (both modes' decode steps side by side) but its ratio is not judged."""
    args = ["--smoke", "--default-too", "--out", str(tmp_path), "--limit", "1000"]
    args += ["--profile", "1"]  # the kernel profile's path runs (no CUDA kernels to see here)
    status = batch_invariance.main(args)  # the CPU's step times prove nothing: no limit
    report = json.loads((tmp_path / "batch_invariance.json").read_text())
    assert status == 0, report["failures"]
    for mode in ("invariant", "default"):
        spec = report["spec"][mode]
        assert len(spec) == 4 and all(r["equal"] == r["requests"] > 0 for r in spec.values())
        for part in ("logits", "chunks"):
            rows = report[part][mode]
            assert rows and all(r["bit_identical"] for r in rows.values()), (part, mode, rows)
    assert set(report["speed"]["tiny"]) == {"1", "2", "4"}
    profiled = report["speed"]["tiny"]["1"]["profile"]  # the smallest and largest batch
    assert set(profiled) == {"default", "invariant"} and "profile" in report["speed"]["tiny"]["4"]
    assert set(profiled["invariant"]) >= {"device_us_per_step", "groups_us", "top_kernels_us"}
    assert set(report["logits"]["invariant"]) == {
        "decode in 3",
        "decode in 9",
        "verify in 3",
        "verify in 9",
    }


def test_a_failed_claim_fails_the_benchmark():
    report = {
        "spec": {"invariant": {"mtp x4": {"equal": 127, "requests": 128}}},
        "logits": {"invariant": {"decode in 9": {"bit_identical": False}}},
        "chunks": {"invariant": {"chunks of 64": {"bit_identical": True}}},
        "speed": {"small": {"8": {"ratio": 1.5}, "16": {"ratio": 1.2}}},
    }
    assert batch_invariance.failures(report, 1.35) == [
        "spec mtp x4: 127/128",
        "logits decode in 9",
        "speed small B8: 1.50x",
    ]
