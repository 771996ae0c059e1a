"""The catalogue of bad inputs the planner refuses: batches, limits, planner builds, dumps.

Every entry is refused with a ``PlanError`` subclass (``ConfigError`` for limits) that
names the field in ``err.field`` and in the message, plus the limit it broke where the
case states one, and no metadata op has launched when it is refused. A bad batch is
refused in every phase it applies to: ``plan()``, and ``replay()`` after a capture.
``docs/reliability.md`` tabulates the entries (kind, example, error class, field, where
checked); ``tests/serving/test_bad_config_catalogue.py`` (the run-config, engine and CLI
parts) keeps the table and both catalogues in step.

Inputs that are *not* refused today are at the end, as ``xfail(strict=True)`` tests: each
turns into an unexpected pass, and so a failure, the day the planner starts refusing it,
and its marker must then go.

There is no floating-point batch input: ``ForwardBatch`` carries only integer tensors
(the model's hidden states are not planner input). A NaN can only arrive in a float
tensor handed over in place of an index tensor, which the dtype check refuses; the
floats that do exist are config values (``loop.arrival_rate``, model ``overrides``,
backend options such as ``nsa.topk``), and those entries are here and in the serving
catalogue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from planner import (
    BatchError,
    ConfigError,
    DumpError,
    ForwardBatch,
    ForwardMode,
    PlanError,
    Planner,
    SchemaError,
)
from planner.dumps import INDEX, dump_plans, load_dump
from tests.support.catalogue import (
    KV_SLOTS,
    NSA_PAGED_64,
    PAGED_16,
    Case,
    Finding,
    case_params,
    expect_finding_refused,
    finding_params,
    refuse,
)
from tests.support.spec_batches import draft_decode_batch, draft_extend_batch

pytestmark = pytest.mark.usefixtures("fresh_deep_gemm")  # a CUDA planner tries deep_gemm once

VERIFY = ForwardMode.TARGET_VERIFY
DOOR = "planner/door.py validate_batch"
STAGING = "planner/staging.py (host values, before any op)"
NSA, PAGED = NSA_PAGED_64, PAGED_16
TABLE, CTX = NSA.table, NSA.max_context
"""Token table of 15 requests over 64-token pages; every slot is below KV_SLOTS."""


def _paged(**overrides) -> Callable[[], ForwardBatch]:
    """The door checks' good batch (3 requests, positions given), with ``overrides``."""
    return lambda: dataclasses.replace(
        PAGED.batch(random.Random(0), bs=3, positions=True), **overrides
    )


def _nsa(**overrides) -> Callable[[], ForwardBatch]:
    """The catalogue's good batch (3 requests, positions given), with ``overrides``."""
    return lambda: dataclasses.replace(
        NSA.batch(random.Random(3), bs=3, positions=True), **overrides
    )


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int32, device="meta")


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- batches: types, ranks, shapes, values, devices, mode; in plan and in replay --------------


BATCH = ("plan", "replay")


def _door(kind: str, batch, field: str, where: str, **kw) -> Case:
    """A door check of the paged planner over 16-token pages: a PlanError naming ``field``."""
    kw = {"error": PlanError, "phases": BATCH, **kw}
    return Case(kind, "batch", batch, field=field, where=where, setup=PAGED, **kw)


def _nsa_case(kind: str, category: str, batch, field: str, limit: str, where: str, **kw):
    """A batch refused by the NSA and paged planner over 64-token pages: a BatchError."""
    kw = {"phases": BATCH, **kw}
    return Case(kind, category, batch, BatchError, field, limit, where, setup=NSA, **kw)


SPEC = {"next_n": 4, "draft_steps": 3}
"""The speculative planner: verify and draft extend of 4 rows per request, 3 draft steps."""


def _draft_extend(**overrides) -> Callable[[], ForwardBatch]:
    """A good draft extend of 3 requests accepting 1, 4 and 2 tokens, with ``overrides``."""
    return lambda: dataclasses.replace(
        draft_extend_batch(
            random.Random(5), TABLE, bs=3, max_context=CTX, next_n=4, accepted=[1, 4, 2]
        ),
        **overrides,
    )


def _draft_decode(**overrides) -> Callable[[], ForwardBatch]:
    """A good 3-step draft decode of 2 requests, with ``overrides``."""
    return lambda: dataclasses.replace(
        draft_decode_batch(random.Random(6), TABLE, bs=2, max_context=CTX, steps=3), **overrides
    )


SPECULATIVE_CASES = [
    _nsa_case(
        "draft extend without accepted counts",
        "batch",
        _draft_extend(extend_lens_cpu=None),
        "extend_lens_cpu",
        "int32 [bs]",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft extend accepting more than next_n",
        "batch",
        _draft_extend(
            extend_lens_cpu=_i32(1, 5, 1), out_cache_loc=torch.zeros(7, dtype=torch.int32)
        ),
        "extend_lens_cpu",
        "<= 4",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft extend accepting nothing",
        "batch",
        _draft_extend(
            extend_lens_cpu=_i32(1, 0, 2), out_cache_loc=torch.zeros(3, dtype=torch.int32)
        ),
        "extend_lens_cpu",
        ">= 1",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft extend slots not one per accepted token",
        "batch",
        _draft_extend(out_cache_loc=torch.zeros(12, dtype=torch.int32)),
        "out_cache_loc",
        "expected 7",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft decode shorter than its steps",
        "batch",
        _draft_decode(seq_lens_cpu=_i32(40, 2)),
        "seq_lens_cpu",
        ">= 3",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft decode steps other than the planner's",
        "batch",
        lambda: draft_decode_batch(random.Random(6), TABLE, bs=2, max_context=CTX, steps=2),
        "next_n",
        "expected 3",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft decode with extend lengths",
        "batch",
        _draft_decode(extend_lens_cpu=_i32(3, 3)),
        "extend_lens_cpu",
        "leave extend_lens_cpu out",
        DOOR,
        planner=SPEC,
    ),
    _nsa_case(
        "draft decode without draft steps",
        "batch",
        _draft_decode(),
        "draft_steps",
        ">= 1",
        "Planner.program (before the door)",
        planner={"next_n": 4},
    ),
]
"""Speculative batches the door refuses before anything is staged (so no capture of their
mode is needed to refuse them in replay)."""

BATCH_CASES = [
    _door("negative length", _paged(seq_lens_cpu=_i32(5, -1, 3)), "seq_lens_cpu", STAGING),
    _door("zero length", _paged(seq_lens_cpu=_i32(5, 0, 3)), "seq_lens_cpu", STAGING),
    _door(
        "length past max context",
        _paged(seq_lens_cpu=_i32(5, PAGED.max_context + 1, 3)),
        "seq_lens_cpu",
        STAGING,
    ),
    _door("lengths int64", _paged(seq_lens_cpu=torch.tensor([5, 6, 3])), "seq_lens_cpu", DOOR),
    _door(
        "lengths 2-D",
        _paged(seq_lens_cpu=torch.tensor([[5, 6, 3]], dtype=torch.int32)),
        "seq_lens_cpu",
        DOOR,
    ),
    _door("lengths not a tensor", _paged(seq_lens_cpu=[5, 6, 3]), "seq_lens_cpu", DOOR),
    _door(
        "lengths non-contiguous",
        _paged(seq_lens_cpu=_i32(5, 9, 6, 9, 3, 9)[::2]),
        "seq_lens_cpu",
        DOOR,
    ),
    _door(
        "empty batch",
        _paged(
            seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
            req_pool_indices=torch.zeros(0, dtype=torch.int64),
            out_cache_loc=torch.zeros(0, dtype=torch.int32),
            positions=None,
        ),
        "seq_lens_cpu",
        DOOR,
    ),
    _door(
        "batch past max_batch",
        _paged(),
        "seq_lens_cpu",
        DOOR,
        error=BatchError,
        limit="max_batch",
        planner={"max_batch": 2, "kv_slots": None},
        captured=2,
        replay_bs=2,
    ),
    _door(
        "pool index out of range",
        _paged(req_pool_indices=torch.tensor([1, 2, 16])),
        "req_pool_indices",
        STAGING,
    ),
    _door(
        "negative pool index",
        _paged(req_pool_indices=torch.tensor([1, -1, 2])),
        "req_pool_indices",
        STAGING,
    ),
    _door(
        "pool indices wrong length",
        _paged(req_pool_indices=torch.tensor([1, 2])),
        "req_pool_indices",
        DOOR,
    ),
    _door(
        "pool indices float",
        _paged(req_pool_indices=torch.tensor([1.0, 2.0, 3.0])),
        "req_pool_indices",
        DOOR,
    ),
    _door("token table int64", _paged(req_to_token=PAGED.table.long()), "req_to_token", DOOR),
    _door(
        "token table one column short",
        _paged(req_to_token=PAGED.table[:, :20].contiguous(), seq_lens_cpu=_i32(5, 21, 3)),
        "req_to_token",
        STAGING,
    ),
    _door("token table 1-D", _paged(req_to_token=PAGED.table[0]), "req_to_token", DOOR),
    _door(
        "token table moved since capture",
        _paged(req_to_token=PAGED.table.clone()),
        "req_to_token",
        "Planner.replay",
        limit="moved or reallocated",
        phases=("replay",),
        planner={"kv_slots": None},
    ),
    _door(
        "replay of a size never captured",
        _paged(),
        "bs",
        "Planner.replay",
        limit="no capture",
        phases=("replay",),
        planner={"kv_slots": None},
        replay_bs=3,
    ),
    _door("out_cache_loc wrong length", _paged(out_cache_loc=_i32(1, 2)), "out_cache_loc", DOOR),
    _door(
        "out_cache_loc past the cache",
        _paged(out_cache_loc=_i32(1, 2, 10**6)),
        "out_cache_loc",
        STAGING,
    ),
    _door(
        "positions past max context",
        _paged(positions=_i32(1, 2, PAGED.max_context)),
        "positions",
        STAGING,
    ),
    _door("next_n mismatch in decode", _paged(next_n=2), "next_n", DOOR),
    _door(
        "verify next_n other than the planner's",
        lambda: PAGED.batch(random.Random(1), next_n=3, mode=VERIFY),
        "next_n",
        DOOR,
        limit="expected 2",
        planner={"next_n": 2, "kv_slots": None},
    ),
    _door("unknown mode", _paged(mode="prefill"), "mode", DOOR),
    _door(
        "device seq_lens disagree",
        _paged(seq_lens=_i32(1, 1, 1)),
        "seq_lens",
        f"{DOOR} (eager and debug only: a device read)",
        skip={
            "replay": "device-resident values are compared only where a sync is allowed "
            "(eager, debug)"
        },
    ),
    _nsa_case(
        "token table on another device",
        "device",
        _nsa(req_to_token=_meta(16, CTX)),
        "req_to_token",
        "wrong device",
        DOOR,
    ),
    _nsa_case(
        "host lengths on a device",
        "device",
        _nsa(seq_lens_cpu=_meta(3)),
        "seq_lens_cpu",
        "wrong device",
        DOOR,
    ),
    _nsa_case(
        "out_cache_loc on another device",
        "device",
        _nsa(out_cache_loc=_meta(3)),
        "out_cache_loc",
        "wrong device",
        DOOR,
    ),
    _nsa_case(
        "CPU batch for a CUDA planner",
        "device",
        _nsa(),
        "req_to_token",
        "expected cuda:0",
        DOOR,
        phases=("plan",),  # replay needs a capture, which a CUDA planner cannot make here
        planner={"backends": ("nsa",), "device": "cuda:0"},
    ),
    _nsa_case(
        "NaN in a float tensor given as an index",
        "batch",
        _nsa(out_cache_loc=torch.tensor([1.0, float("nan"), 2.0])),
        "out_cache_loc",
        "int32 or torch.int64",
        DOOR,
    ),
    _nsa_case(
        "lengths of dtype bool",
        "batch",
        _nsa(seq_lens_cpu=torch.ones(3, dtype=torch.bool)),
        "seq_lens_cpu",
        "torch.int32",
        DOOR,
    ),
    _nsa_case(
        "int64 slot past int32 (kv_slots set)",
        "batch",
        _nsa(out_cache_loc=torch.tensor([1, 2, 2**32 + 5])),
        "out_cache_loc",
        f"[0, {KV_SLOTS - 1}]",
        STAGING,
    ),
    _nsa_case(
        "int64 slot past int32 (no kv_slots)",
        "batch",
        _nsa(out_cache_loc=torch.tensor([1, 2, 2**32 + 5])),
        "out_cache_loc",
        "2147483647",
        STAGING,
        planner={"kv_slots": None},
    ),
    _nsa_case(
        "int64 pool index past int32",
        "batch",
        _nsa(req_pool_indices=torch.tensor([1, 2, 2**40])),
        "req_pool_indices",
        "[0, 15]",
        STAGING,
    ),
    _nsa_case(
        "verify batch on a decode-only planner",
        "batch",
        lambda: NSA.batch(random.Random(1), next_n=2, mode=VERIFY),
        "next_n",
        "expected 1",
        DOOR,
        planner={"next_n": 1},
    ),
    *SPECULATIVE_CASES,
    _nsa_case(
        "not a ForwardBatch",
        "batch",
        lambda: {"seq_lens_cpu": torch.ones(1)},
        "batch",
        "dict",
        DOOR,
        planner={"backends": ("paged",)},
    ),
]
"""Every bad batch: the door checks of the paged planner (PlanError, the field named), then
devices, dtypes and int64 values on the NSA and paged planner (BatchError, the limit too)."""


# ---- calls: plan and capture arguments, Limits, the planner's build ----------------------------

LIMIT_CASES = [
    ("max_batch", dict(max_batch=0), "greater than or equal to 1"),
    ("max_context", dict(max_context=float("nan")), "finite number"),
    ("page_size", dict(page_size=0), "greater than or equal to 1"),
    ("next_n", dict(next_n=17), "less than or equal to 16"),
    ("kv_slots", dict(kv_slots=0), "greater than or equal to 1"),
    ("device", dict(device="gpu"), "not a torch device"),
    ("max_bs", dict(max_bs=8), "Extra inputs are not permitted"),
]
"""(field, bad value, the limit the message states): Limits' own pydantic validation."""


def _build(backends, limits=None, **kwargs) -> Callable[[], Planner]:
    return lambda: Planner(backends, limits or NSA.make_limits(), **kwargs)


NSA_CHECK = "backends/nsa/plan.py NSAPlan.check_settings (Planner build)"

CALL_CASES = [
    Case(
        "pad_to below the batch",
        "batch",
        lambda: NSA.planner(["paged"]).plan(_nsa()(), pad_to=2),
        BatchError,
        "pad_to",
        "[3, 4]",
        "Planner.plan",
    ),
    Case(
        "capture size past max_batch",
        "batch",
        lambda: NSA.planner(["paged"]).capture(5, req_to_token=TABLE),
        BatchError,
        "bs",
        "[1, 4]",
        "Planner.capture",
    ),
    Case(
        "capture over an int64 token table",
        "batch",
        lambda: NSA.planner(["paged"]).capture(2, req_to_token=TABLE.long()),
        BatchError,
        "req_to_token",
        "torch.int32",
        "Planner.capture (validate_batch of the dummy batch)",
    ),
    *[
        Case(
            f"Limits.{field}",
            "limits",
            lambda bad=bad: NSA.make_limits(**bad),
            ConfigError,
            field,
            limit,
            "planner/limits.py Limits",
        )
        for field, bad, limit in LIMIT_CASES
    ],
    Case(
        "unknown backend",
        "backend",
        _build(["nsa", "flashattention"]),
        SchemaError,
        "backend",
        "'paged'",
        "planner/registry.py get_backend",
    ),
    Case(
        "no backend",
        "backend",
        _build([]),
        SchemaError,
        "backends",
        "at least one backend",
        "Planner.__init__",
    ),
    Case(
        "options for a backend not planned",
        "backend",
        _build(["nsa"], options={"paged": {}}),
        SchemaError,
        "options",
        "['nsa']",
        "Planner.__init__",
    ),
    Case(
        "NSA over pages other than 64",
        "config",
        _build(["nsa"], NSA.make_limits(page_size=32)),
        SchemaError,
        "page_size",
        "expected 64",
        NSA_CHECK,
    ),
    Case(
        "NSA block_kv other than 64",
        "config",
        _build(["nsa"], options={"nsa": {"block_kv": 128}}),
        SchemaError,
        "nsa.block_kv",
        "expected 64",
        NSA_CHECK,
    ),
    Case(
        "NSA native next_n outside deep_gemm's 1 or 2",
        "config",
        _build(["nsa"], options={"nsa": {"native_next_n": (1, 2, 4)}}),
        SchemaError,
        "nsa.native_next_n",
        "(1, 2)",
        NSA_CHECK,
    ),
    Case(
        "NSA top-k NaN",
        "config",
        _build(["nsa"], options={"nsa": {"topk": float("nan")}}),
        SchemaError,
        "nsa.topk",
        ">= 1",
        NSA_CHECK,
    ),
    Case(
        "NSA schedule layout unknown",
        "config",
        _build(["nsa"], options={"nsa": {"schedule_layout": "0.2"}}),
        SchemaError,
        "nsa.schedule_layout",
        "'new'",
        NSA_CHECK,
    ),
]


@pytest.mark.parametrize(("case", "phase"), case_params(BATCH_CASES + CALL_CASES))
def test_bad_input_is_refused_naming_the_field(case, phase, monkeypatch):
    launched = refuse(case, phase, monkeypatch)
    assert launched == [], f"an op ran before the input was refused: {launched}"


# ---- dumps -------------------------------------------------------------------------------------


@pytest.fixture
def dump_dir(tmp_path) -> Path:
    return dump_plans(NSA.planner().plan(_nsa()()), tmp_path / "dump", step=1)


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DUMP_CASES = {
    "dump path missing": (lambda d: d.rename(d.parent / "moved"), "does not exist"),
    "dump truncated": (
        lambda d: (d / "nsa.safetensors").write_bytes((d / "nsa.safetensors").read_bytes()[:-9]),
        "truncated plan dump",
    ),
    "dump tensor bytes flipped": (
        lambda d: _flip_last_byte(d / "paged.safetensors"),
        "checksum mismatch for field",
    ),
    "dump from a newer format": (
        lambda d: _edit_json(d / INDEX, lambda j: j.update(format_version=99)),
        "unsupported plan dump version",
    ),
    "dump index names a file outside it": (
        lambda d: _edit_json(
            d / INDEX, lambda j: j["backends"]["nsa"].update(tensors="../../secret")
        ),
        "unsafe file",
    ),
}
"""kind -> (how to corrupt a dump directory, what load_dump's DumpError says)."""


@pytest.mark.parametrize("kind", sorted(DUMP_CASES))
def test_corrupt_dump_is_a_dump_error(dump_dir, kind):
    corrupt, message = DUMP_CASES[kind]
    corrupt(dump_dir)
    with pytest.raises(DumpError, match=message) as info:
        load_dump(dump_dir)
    if kind == "dump tensor bytes flipped":
        assert info.value.field.startswith("paged.")


# ---- not refused today: each is a finding (see docs/reliability.md) ---------------------------


def _table_with(value: int) -> torch.Tensor:
    table = TABLE.clone()
    table[_nsa()().req_pool_indices[0], 0] = value
    return table


def _debug_env(tmp: Path) -> object:
    old = os.environ.get("PLANNER_DEBUG")
    os.environ["PLANNER_DEBUG"] = "maybe"  # "true"/"yes"/"on" turn it on; a typo must not be "off"
    try:
        planner = NSA.planner(["paged"])
    finally:
        if old is None:
            del os.environ["PLANNER_DEBUG"]
        else:
            os.environ["PLANNER_DEBUG"] = old
    if not planner.debug:
        return "PLANNER_DEBUG=maybe left debug mode off"
    return planner


NOT_REFUSED = [
    Finding(
        "token table entry past the KV cache",
        "req_to_token values are never range-checked: a slot past kv_slots becomes a page id past "
        "the cache in nsa.page_table / paged.token_slots",
        lambda tmp: NSA.planner().plan(_nsa(req_to_token=_table_with(10**6))()),
        ("req_to_token", "nsa.token_slots", "paged.token_slots"),
    ),
    Finding(
        "negative token table entry",
        "a slot of -5 becomes page id -1 in nsa.page_table (a negative index in the kernel)",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(req_to_token=_table_with(-5))()),
        ("req_to_token", "nsa.token_slots"),
    ),
    Finding(
        "two tokens writing one KV slot",
        "duplicate out_cache_loc entries are accepted; two rows then write the same slot",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(out_cache_loc=_i32(300, 300, 301))()),
        ("out_cache_loc",),
    ),
    Finding(
        "positions disagreeing with lengths",
        "positions are range-checked only; a decode token at position 0 of a 100-token request "
        "gets the wrong rope silently",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(positions=torch.zeros(3, dtype=torch.int32))()),
        ("positions",),
    ),
    Finding(
        "unknown backend option",
        "options={'nsa': {'topkk': 5}} is merged into the settings and ignored, so the typo "
        "leaves top-k at its default",
        lambda tmp: NSA.planner(["nsa"], options={"nsa": {"topkk": 5}}),
        ("options", "nsa", "nsa.topkk"),
        fixed=True,
    ),
    Finding(
        "PLANNER_DEBUG=true",
        "only the exact value '1' enables debug mode; 'true', 'yes', 'on' silently leave it "
        "off (PLANNER_DUMP_* values are validated, this one is not)",
        _debug_env,
        ("PLANNER_DEBUG",),
        fixed=True,
    ),
]
"""The planner's findings; the run config's and the engine's are in the serving catalogue."""

if not torch.cuda.is_available():
    NOT_REFUSED.append(
        Finding(
            "CUDA planner without CUDA",
            "Limits(device='cuda') builds, then Planner() raises torch's raw AssertionError "
            "('Torch not compiled with CUDA enabled') from Limits.torch_device",
            lambda tmp: NSA.planner(["paged"], device="cuda"),
            ("device",),
            fixed=True,
        )
    )


@pytest.mark.parametrize("finding", finding_params(NOT_REFUSED))
def test_not_refused_today(finding, tmp_path):
    expect_finding_refused(finding, tmp_path)


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("On", True), ("0", False), ("no", False), ("", False)],
)
def test_planner_debug_env_values(value, on, monkeypatch):
    monkeypatch.setenv("PLANNER_DEBUG", value)
    assert NSA.planner(["paged"]).debug is on


KINDS = [c.kind for c in BATCH_CASES + CALL_CASES] + sorted(DUMP_CASES)
KINDS += [f.kind for f in NOT_REFUSED]
"""Every kind of this catalogue: each has its row in docs/reliability.md."""
