"""The catalogue of bad inputs the planner refuses: batches, limits, planner builds, dumps.

Every entry is refused with a ``PlanError`` subclass (``ConfigError`` for limits) that
names the field in ``err.field`` and in the message, plus the limit it broke where the
case states one. A bad batch is refused in every phase it applies to: ``plan()``, and
``replay()`` after a capture. What the host knows without reading values (types, ranks,
lengths, counts, sizes: the door) is refused by the call itself, before any metadata op
has launched. Values and their relations are refused by the device check
(``planner/device_checks.py``): ``plan()`` runs it first and raises at once, so no
metadata op has launched then either; a replay hands them to the captured graph, whose
check replaces every row with its pad before any op reads it, so no op reads a real row
of a refused batch and no KV slot but the null slot is written, and ``Planner.read``
raises with the step's outputs, returning none of them (``tests/support/catalogue.py``
``refuse``). ``docs/reliability.md`` tabulates the entries (kind, example, error class,
field, where checked); ``tests/serving/test_bad_config_catalogue.py`` (the run-config,
engine and CLI parts) keeps the table and both catalogues in step.

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
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from graphs import GraphRunner
from planner import (
    BatchError,
    ConfigError,
    DumpError,
    ForwardBatch,
    ForwardMode,
    Limits,
    Plan,
    PlanError,
    Planner,
    PlanSet,
    PlanWriteError,
    SchemaError,
    Tensor,
    tensor_field,
)
from planner.debug import diff_plans
from planner.dumps import INDEX, dump_plans, load_dump
from planner.registry import get_backend
from tests.support import REPO
from tests.support.catalogue import (
    KV_SLOTS,
    NSA_PAGED_64,
    PAGED_16,
    Case,
    Finding,
    case_params,
    expect_finding_refused,
    finding_params,
    not_pads,
    refuse,
)
from tests.support.graph_model import TinyPagedModel
from tests.support.spec_batches import draft_decode_batch, draft_extend_batch

# a CUDA planner tries deep_gemm once; throwaway schemas are forgotten after each test
pytestmark = pytest.mark.usefixtures("fresh_deep_gemm", "isolated_registries")

VERIFY = ForwardMode.TARGET_VERIFY
DOOR = "planner/checks.py validate_batch"
DEVICE = "device check (planner/device_checks.py), raised at plan() / at read()"
"""Where every value and relation of a batch is refused (``Case.at_read``)."""
INT32 = "planner/step_inputs.py write_batch (int64 past int32, before anything is sent)"
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


def _table_with(value: int) -> torch.Tensor:
    """The catalogue's token table with one slot of the good batch's first request changed."""
    table = TABLE.clone()
    table[NSA.batch(random.Random(3), bs=3, positions=True).req_pool_indices[0], 0] = value
    return table


def _twice(batch: ForwardBatch) -> ForwardBatch:
    """The batch with its first request in place of its second (slots, positions kept)."""
    pools = batch.req_pool_indices.clone()
    pools[1] = pools[0]
    return dataclasses.replace(batch, req_pool_indices=pools)


# ---- batches: types, ranks, shapes, values, devices, mode; in plan and in replay --------------


BATCH = ("plan", "replay")


def _door(kind: str, batch, field: str, where: str, **kw) -> Case:
    """A door check of the paged planner over 16-token pages: a PlanError naming ``field``."""
    kw = {"error": PlanError, "phases": BATCH, **kw}
    return Case(kind, "batch", batch, field=field, where=where, setup=PAGED, **kw)


LENS = f"[1, {PAGED.max_context}]"
"""The paged planner's decode lengths: one new token, at most max_context."""


def _value(kind: str, batch, field: str, **kw) -> Case:
    """A value of the paged planner's batch the device check refuses (``Case.at_read``)."""
    return _door(kind, batch, field, DEVICE, at_read=True, **kw)


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
    _value("negative length", _paged(seq_lens_cpu=_i32(5, -1, 3)), "seq_lens_cpu", limit=LENS),
    _value("zero length", _paged(seq_lens_cpu=_i32(5, 0, 3)), "seq_lens_cpu", limit=LENS),
    _value(
        "length past max context",
        _paged(seq_lens_cpu=_i32(5, PAGED.max_context + 1, 3)),
        "seq_lens_cpu",
        limit=LENS,
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
    _value(
        "pool index out of range",
        _paged(req_pool_indices=torch.tensor([1, 2, 16])),
        "req_pool_indices",
        limit="[0, 15]",
    ),
    _value(
        "negative pool index",
        _paged(req_pool_indices=torch.tensor([1, -1, 2])),
        "req_pool_indices",
        limit="[0, 15]",
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
    _value(
        "token table one column short",
        _paged(req_to_token=PAGED.table[:, :20].contiguous(), seq_lens_cpu=_i32(5, 21, 3)),
        "req_to_token",
        limit=">= 21 columns",
        own_table=True,
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
    _value(
        "out_cache_loc past the cache",
        _paged(out_cache_loc=_i32(1, 2, 10**6)),
        "out_cache_loc",
        limit="[0, 99999]",
    ),
    _value(
        "positions past max context",
        _paged(positions=_i32(1, 2, PAGED.max_context)),
        "positions",
        limit=f"[0, {PAGED.max_context - 1}]",
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
        "replay size a float",
        _paged(),
        "bs",
        "Planner.replay",
        limit="an int in [1, 4]",
        phases=("replay",),
        planner={"kv_slots": None},
        replay_bs=4.0,
    ),
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
        planner={"backends": ("nsa",), "device": "cuda:0", "fake_cuda": True},
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
        "[-2147483648, 2147483647]",
        INT32,
    ),
    _nsa_case(
        "int64 slot past int32 (no kv_slots)",
        "batch",
        _nsa(out_cache_loc=torch.tensor([1, 2, 2**32 + 5])),
        "out_cache_loc",
        "[-2147483648, 2147483647]",
        INT32,
        planner={"kv_slots": None},
    ),
    _nsa_case(
        "int64 pool index past int32",
        "batch",
        _nsa(req_pool_indices=torch.tensor([1, 2, 2**40])),
        "req_pool_indices",
        "[-2147483648, 2147483647]",
        INT32,
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
        "one KV slot written twice",
        "batch",
        _nsa(out_cache_loc=_i32(300, 300, 301)),
        "out_cache_loc",
        "got 300",
        DEVICE,
        at_read=True,
    ),
    _nsa_case(
        "one request twice in a batch",
        "batch",
        lambda: _twice(_nsa()()),
        "req_pool_indices",
        "a request twice",
        DEVICE,
        at_read=True,
    ),
    _nsa_case(
        "positions other than the lengths imply",
        "batch",
        _nsa(positions=torch.zeros(3, dtype=torch.int32)),
        "positions",
        "disagree with the lengths",
        DEVICE,
        at_read=True,
    ),
    _nsa_case(
        "token table entry at kv_slots",
        "batch",
        _nsa(req_to_token=_table_with(KV_SLOTS)),
        "req_to_token",
        f"[0, {KV_SLOTS - 1}]",
        DEVICE,
        at_read=True,
        own_table=True,
    ),
    _nsa_case(
        "token table entry negative",
        "batch",
        _nsa(req_to_token=_table_with(-5)),
        "req_to_token",
        "got -5",
        DEVICE,
        at_read=True,
        own_table=True,
    ),
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
    ("max_batch", "max_batch", dict(max_batch=0), "greater than or equal to 1"),
    ("max_context", "max_context", dict(max_context=float("nan")), "valid integer"),
    ("page_size", "page_size", dict(page_size=0), "greater than or equal to 1"),
    ("next_n", "next_n", dict(next_n=17), "less than or equal to 16"),
    ("kv_slots", "kv_slots", dict(kv_slots=0), "greater than or equal to 1"),
    ("device", "device", dict(device="gpu"), "not a torch device"),
    ("max_bs", "max_bs", dict(max_bs=8), "Extra inputs are not permitted"),
    ("max_batch as a string", "max_batch", dict(max_batch="8"), "got '8'"),
    ("num_sms as a float", "num_sms", dict(num_sms=8.0), "valid integer"),
    (
        "max_static_bytes negative",
        "max_static_bytes",
        dict(max_static_bytes=-1),
        "greater than or equal to 0",
    ),
    *(
        [("device past the CUDA devices", "device", dict(device="cuda:999"), "CUDA devices")]
        if torch.cuda.is_available()
        else [("CUDA device without CUDA", "device", dict(device="cuda:0"), "not available")]
    ),
]
"""(kind, field, bad value, the limit the message states): Limits' own validation (strict
types; a CUDA device must exist here)."""


def _build(backends, limits=None, **kwargs) -> Callable[[], Planner]:
    return lambda: Planner(backends, limits or NSA.make_limits(), **kwargs)


NSA_CHECK = "backends/nsa/plan.py NSAPlan.check_settings (Planner build)"
OPTIONS = "planner/program.py check_options (Planner build)"


def _user_paged_plan() -> type:
    """User code declaring a backend named like the installed ``paged`` (same modes)."""

    class MyPaged(Plan, backend="paged"):
        seq_lens: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)

    return MyPaged


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
            f"Limits.{kind}",
            "limits",
            lambda bad=bad: NSA.make_limits(**bad),
            ConfigError,
            field,
            limit,
            "planner/limits.py Limits",
        )
        for kind, field, bad, limit in LIMIT_CASES
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
        ConfigError,
        "nsa.topk",
        "expected int, got nan (float)",
        OPTIONS,
    ),
    Case(
        "backend option of the wrong type",
        "config",
        _build(["nsa"], options={"nsa": {"topk": "2048"}}),
        ConfigError,
        "nsa.topk",
        "expected int, got '2048' (str)",
        OPTIONS,
    ),
    *[
        Case(
            f"backend option a limit owns ({key})",
            "config",
            _build([backend], options={backend: {key: value}}),
            ConfigError,
            f"{backend}.{key}",
            f"set it in Limits({key}=...)",
            OPTIONS,
        )
        for backend, key, value in (
            ("paged", "page_size", 16),
            ("nsa", "next_n", 2),
            ("nsa", "num_sms", 8),
            ("nsa", "max_batch", 2),
            ("nsa", "kv_slots", 10),
            ("nsa", "device", "cpu"),
        )
    ],
    Case(
        "backend option a batch dimension (max_len)",
        "config",
        _build(["nsa"], options={"nsa": {"max_len": 5}}),
        ConfigError,
        "nsa.max_len",
        "derived from each batch",
        OPTIONS,
    ),
    Case(
        "user class taking an installed backend's name",
        "backend",
        lambda: _user_paged_plan(),
        SchemaError,
        "paged",
        "already plans",
        "planner/registry.py register_backend (class definition)",
    ),
    Case(
        "static buffers past the memory budget",
        "limits",
        _build(["nsa", "paged"], Limits(max_batch=4096, max_context=1 << 20)),
        ConfigError,
        "nsa.token_slots",
        "over Limits.max_static_bytes",
        "planner/storage.py Storages.check_budget (Planner build, before any allocation)",
    ),
    Case(
        "capture size a float",
        "batch",
        lambda: NSA.planner(["paged"]).capture(4.0, req_to_token=TABLE),
        BatchError,
        "bs",
        "an int in [1, 4]",
        "Planner.capture",
    ),
    Case(
        "pad_to a float",
        "batch",
        lambda: NSA.planner(["paged"]).plan(_nsa()(), pad_to=4.0),
        BatchError,
        "pad_to",
        "an int in [3, 4]",
        "Planner.plan",
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


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "phase"), case_params([c for c in BATCH_CASES if c.at_read]))
def test_the_device_check_refuses_on_the_gpu(case, phase, monkeypatch):
    """Every value the device check refuses, on a CUDA planner: ``plan()`` raises at once, a
    replay through a CUDA graph reaches no plan with it and raises at the read."""
    launched = refuse(case, phase, monkeypatch, device="cuda")
    assert launched == [], f"an op ran on the host before the input was refused: {launched}"


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


# ---- plans: layers only read them -------------------------------------------------------------


def _paged_plans():
    return PAGED.planner().plan(PAGED.batch(random.Random(0), bs=3))


def _assign() -> None:
    plan = _paged_plans()["paged"]
    plan.kv_lens = plan.kv_lens + 1


def _delete() -> None:
    del _paged_plans()["paged"].page_table


def _replace_plan() -> None:
    plans = _paged_plans()
    plans["paged"] = plans["paged"].model_copy()


def _layer_writes(phase: str) -> None:
    """A graph runner (emulated graphs, debug off) whose forward's layer writes
    ``paged.seq_lens`` in place in plans of ``phase``; one step of a batch that runs
    eagerly (past the captured size) or replays (after the capture)."""
    model = TinyPagedModel(int(PAGED.table.max()) + 1)

    def forward(inputs, plans):
        if plans.phase == phase:
            plans["paged"].seq_lens[:1] += 1
        return model(inputs, plans)

    runner = GraphRunner(
        PAGED.planner(),
        forward,
        req_to_token=PAGED.table,
        static_inputs={"input_ids": torch.int64},
        sizes=[2],
    )
    batch = PAGED.batch(random.Random(0), bs=3 if phase == "eager" else 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager fallback's GraphWarning
        runner.step(batch, {"input_ids": torch.zeros(batch.bs, dtype=torch.int64)})


PLAN_WRITES = {
    "plan field reassignment": (_assign, "paged.kv_lens", "Plan.__setattr__"),
    "plan field deleted": (_delete, "paged.page_table", "Plan.__delattr__"),
    "plan set given another plan": (_replace_plan, "paged", "PlanSet.__setitem__"),
    "plan field written in place (eager forward)": (
        lambda: _layer_writes("eager"),
        "paged.seq_lens",
        "graphs/plan_writes.py refuse_plan_writes (GraphRunner, every eager forward)",
    ),
    "plan field written in place (graph capture)": (
        lambda: _layer_writes("capture"),
        "paged.seq_lens",
        "graphs/plan_writes.py refuse_plan_writes (GraphRunner, every capture's forward)",
    ),
}
"""Kind: (what does it, the field named, where it is refused). Refused in every mode,
debug or not, with one line naming the field (never pydantic's ``ValidationError``)."""


@pytest.mark.parametrize("kind", sorted(PLAN_WRITES))
def test_a_plan_written_is_refused_naming_the_field(kind):
    run, field, _ = PLAN_WRITES[kind]
    with pytest.raises(PlanWriteError) as info:
        run()
    assert info.value.field == field and f"[{field}]" in str(info.value)
    assert "\n" not in str(info.value)


# ---- not refused today: each is a finding (see docs/reliability.md) ---------------------------


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
        fixed=True,
    ),
    Finding(
        "negative token table entry",
        "a slot of -5 becomes page id -1 in nsa.page_table (a negative index in the kernel)",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(req_to_token=_table_with(-5))()),
        ("req_to_token", "nsa.token_slots"),
        fixed=True,
    ),
    Finding(
        "two tokens writing one KV slot",
        "duplicate out_cache_loc entries are accepted; two rows then write the same slot",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(out_cache_loc=_i32(300, 300, 301))()),
        ("out_cache_loc",),
        fixed=True,
    ),
    Finding(
        "positions disagreeing with lengths",
        "positions are range-checked only; a decode token at position 0 of a 100-token request "
        "gets the wrong rope silently",
        lambda tmp: NSA.planner(["nsa"]).plan(_nsa(positions=torch.zeros(3, dtype=torch.int32))()),
        ("positions",),
        fixed=True,
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
    Finding(
        "backend option overriding a limit",
        "options={'paged': {'page_size': 16}} under Limits(page_size=64): the page table has the "
        "64-token shape but holds 16-token page ids, and debug verify() agrees (eager is wrong "
        "the same way)",
        lambda tmp: NSA.planner(["paged"], options={"paged": {"page_size": 16}}),
        ("paged.page_size",),
        fixed=True,
    ),
    Finding(
        "backend options the planner ignored",
        "options={'nsa': {'next_n': 2}} and {'max_len': 5} were accepted and ignored",
        lambda tmp: NSA.planner(["nsa"], options={"nsa": {"max_len": 5}}),
        ("nsa.max_len",),
        fixed=True,
    ),
    Finding(
        "num_sms option failing at the first batch",
        "options={'nsa': {'num_sms': 8}} built, then failed at the first batch naming the "
        "internal '[out]'",
        lambda tmp: NSA.planner(["nsa"], options={"nsa": {"num_sms": 8}}),
        ("nsa.num_sms",),
        fixed=True,
    ),
    Finding(
        "user class replacing an installed backend",
        "class X(Plan, backend='paged') defined before the registry loaded the entry points "
        "replaced the installed paged backend (its entry point failed with one warning); see "
        "test_a_user_class_never_replaces_an_installed_backend",
        lambda tmp: _user_paged_plan(),
        ("paged",),
        fixed=True,
    ),
    Finding(
        "size argument a float",
        "replay(batch, 4.0) and plan(batch, pad_to=4.0) raised a raw TypeError from slicing",
        lambda tmp: NSA.planner(["paged"]).plan(_nsa()(), pad_to=4.0),
        ("pad_to",),
        fixed=True,
    ),
    Finding(
        "static buffers of many GiB",
        "Limits(max_batch=4096, max_context=1 << 20) built and tried to allocate 16 GiB of "
        "static buffers at the first capture, with no estimate or warning",
        lambda tmp: Planner(["nsa", "paged"], Limits(max_batch=4096, max_context=1 << 20)),
        ("nsa.token_slots",),
        fixed=True,
    ),
]
"""The planner's findings; the run config's and the engine's are in the serving catalogue."""

if not torch.cuda.is_available():
    NOT_REFUSED += [
        Finding(
            "CUDA planner without CUDA",
            "Limits(device='cuda') builds, then Planner() raises torch's raw AssertionError "
            "('Torch not compiled with CUDA enabled') from Limits.torch_device",
            lambda tmp: NSA.planner(["paged"], device="cuda"),
            ("device",),
            fixed=True,
        ),
        Finding(
            "CUDA device index without CUDA",
            "Limits(device='cuda:0') on a CPU-only machine built, and failed only at capture",
            lambda tmp: Limits(max_batch=4, max_context=64, device="cuda:0"),
            ("device",),
            fixed=True,
        ),
    ]


@pytest.mark.parametrize("finding", finding_params(NOT_REFUSED))
def test_not_refused_today(finding, tmp_path):
    expect_finding_refused(finding, tmp_path)


USER_CLASS_FIRST = """
import warnings
warnings.simplefilter("error")  # an entry point failing to load would be a warning
import torch
from planner import Plan, Planner, Limits, SchemaError, Tensor, tensor_field
try:
    class MyPaged(Plan, backend="paged"):
        seq_lens: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
except SchemaError as exc:
    print("refused:", exc.field)
planner = Planner(["paged"], Limits(max_batch=2, max_context=64))
print(planner.schemas["paged"].__module__)
"""


def test_a_user_class_never_replaces_an_installed_backend():
    """Declared before anything loaded the installed backends (a fresh interpreter), a user
    class named ``paged`` is refused at its definition and the installed one is planned."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", USER_CLASS_FIRST], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused:", "paged", "backends.paged.plan"]


def test_the_same_class_imported_again_replaces_itself():
    """A reload (same module and qualified name) is the class again, not a second backend."""
    first = _user_backend_plan()
    again = _user_backend_plan()
    assert get_backend("test-reloaded") is again and again is not first


def _user_backend_plan() -> type:
    class Reloaded(Plan, backend="test-reloaded"):
        seq_lens: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)

    return Reloaded


def test_sizes_may_be_numpy_integers():
    """Sizes are refused as floats or bools, not as numpy integers (an engine's arithmetic)."""
    planner = NSA.planner(["paged"])
    captured = planner.capture(np.int64(4), req_to_token=TABLE)
    assert planner.replay(_nsa()(), np.int32(4)) is captured
    assert planner.plan(_nsa()(), pad_to=np.int64(4)).reqs == 4
    with pytest.raises(BatchError):
        planner.replay(_nsa()(), True)


@pytest.mark.parametrize("debug", [False, True])
def test_a_table_entry_changed_after_the_capture_is_refused_at_every_replay(debug):
    """The device check reads the token table's entries the batch uses at every replay, debug
    or not: one changed in place to ``kv_slots`` since the capture reaches no plan and is
    refused at the read (debug: ``verify`` reads it first), naming the table's row and column."""
    table = TABLE.clone()
    batch = dataclasses.replace(_nsa()(), req_to_token=table)
    planner = NSA.planner(debug=debug)
    planner.capture(4, req_to_token=table)
    pool = int(batch.req_pool_indices[0])
    table[pool, 0] = KV_SLOTS
    plans = planner.replay(batch, 4)
    planner.record(4)
    assert not_pads(planner, plans) == {}
    read = (lambda: planner.verify(batch, plans)) if debug else planner.read_errors
    with pytest.raises(BatchError, match=rf"\[0, {KV_SLOTS - 1}\]") as info:
        read()
    assert info.value.field == "req_to_token" and f"req_to_token[{pool}, 0]" in str(info.value)


def _replay_and_run(planner: Planner, batch: ForwardBatch, bs: int = 4) -> PlanSet:
    """A replay and its graph's part (what an emulated graph runs after ``replay``)."""
    plans = planner.replay(batch, bs)
    planner.record(bs, batch.plans_as)
    return plans


def test_after_a_refusal_is_read_the_next_batch_replays_and_reads_clean():
    """The error word is sticky until read: a second refused batch, or a good one, does not
    hide the first refusal (its field is named). Once read, the word is clear, and the next
    good batch's replay equals its padded eager plan and reads its outputs."""
    planner = NSA.planner()
    planner.capture(4, req_to_token=TABLE)
    good = _nsa()()
    _replay_and_run(planner, _twice(good))
    _replay_and_run(planner, _nsa(positions=torch.zeros(3, dtype=torch.int32))())
    _replay_and_run(planner, good)
    with pytest.raises(BatchError) as info:
        planner.read(torch.arange(3))
    assert info.value.field == "req_pool_indices", str(info.value)
    assert planner.errors.tolist() == [0] * len(planner.errors)
    planner.read_errors()  # nothing left
    plans = _replay_and_run(planner, good)
    assert planner.read(torch.arange(3)) == [0, 1, 2]
    assert diff_plans(plans, planner.plan(good, pad_to=4)) == []


def test_a_refused_batch_the_engine_wrote_into_the_slot_reaches_no_plan():
    """The engine's own way in (``step_inputs``: nothing written again by the planner) is
    checked the same: a KV slot written twice is refused at the read, naming the field and
    the row, and the plans hold pads only."""
    planner = NSA.planner()
    planner.capture(4, req_to_token=TABLE)
    good = _nsa()()
    inputs = planner.step_inputs(ForwardMode.DECODE)
    inputs.seq_lens[:3] = good.seq_lens_cpu.numpy()
    inputs.extend_lens[:3] = 1
    inputs.req_pool_indices[:3] = good.req_pool_indices.numpy()
    inputs.out_cache_loc[:3] = [300, 301, 300]
    inputs.set_counts(3, 3, positions_given=False)
    plans = _replay_and_run(planner, inputs.batch(TABLE))
    assert not_pads(planner, plans) == {}
    with pytest.raises(BatchError, match="entries 0 and 2") as info:
        planner.read(torch.arange(3))
    assert info.value.field == "out_cache_loc" and info.value.actual == 300


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("On", True), ("0", False), ("no", False), ("", False)],
)
def test_planner_debug_env_values(value, on, monkeypatch):
    monkeypatch.setenv("PLANNER_DEBUG", value)
    assert NSA.planner(["paged"]).debug is on


KINDS = [c.kind for c in BATCH_CASES + CALL_CASES] + sorted(DUMP_CASES)
KINDS += [f.kind for f in NOT_REFUSED]
KINDS += sorted(PLAN_WRITES)
"""Every kind of this catalogue: each has its row in docs/reliability.md."""
