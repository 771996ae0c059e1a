"""The catalogue of bad inputs beyond the batch door checks of ``test_bad_input.py``.

Every entry is refused with a ``PlanError`` subclass (``ConfigError`` for configs) that
names the field in ``err.field`` and in the message, plus the limit it broke where there
is one, and nothing has launched when it is refused. ``docs/reliability.md`` tabulates
the entries (kind, example, error class, field, where checked); a test below keeps the
table and this file in step.

Inputs that are *not* refused today (silently accepted, or refused with a raw exception
that an engine catching ``PlanError`` would not catch) are at the end, as
``xfail(strict=True)`` tests: each turns into an unexpected pass, and so a failure, the
day the planner starts refusing it, and its marker must then go.

There is no floating-point batch input: ``ForwardBatch`` carries only integer tensors
(the model's hidden states are not planner input). A NaN can only arrive in a float
tensor handed over in place of an index tensor, which the dtype check refuses; the
floats that do exist are config values (``loop.arrival_rate``, model ``overrides``,
backend options such as ``nsa.topk``), and those entries are here.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import backends.deepgemm._native as native
from graphs import GraphRunner
from models.config import DSV32Config
from models.model import Block, DSV32Model
from planner import (
    BatchError,
    ConfigError,
    DumpError,
    ForwardBatch,
    ForwardMode,
    Limits,
    PlanError,
    Planner,
    ProviderError,
    SchemaError,
)
from planner.dumps import INDEX, dump_plans, load_dump
from planner.program import Step
from serving.dump_ring import DumpRing
from serving.engine import DecodeEngine
from serving.run_config import load_run_config
from tests.support import REPO, TINY_YAML
from tests.support.batches import make_pool, random_batch

MAX_CTX, PAGE, KV_SLOTS = 256, 64, 20 * 256
TABLE = make_pool(16, MAX_CTX, PAGE)
"""Token table of 15 requests over 64-token pages; every slot is below KV_SLOTS."""


def _limits(**overrides) -> Limits:
    values = dict(max_batch=4, max_context=MAX_CTX, page_size=PAGE, kv_slots=KV_SLOTS)
    return Limits(**{**values, **overrides})


def _good(**overrides) -> ForwardBatch:
    batch = random_batch(
        random.Random(3), TABLE, max_batch=4, max_context=MAX_CTX, bs=3, positions=True
    )
    return dataclasses.replace(batch, **overrides)


@dataclass(frozen=True)
class Case:
    """One kind of bad input: how to make it, and how it must be refused."""

    kind: str
    category: str
    run: Callable[[], object]
    error: type[PlanError]
    field: str
    limit: str | None = None
    where: str = ""


_TINY_MODEL: list[DSV32Model] = []


def _tiny_model() -> DSV32Model:
    """One tiny model per session for the engine-level cases (building one costs ~0.7 s)."""
    if not _TINY_MODEL:
        _TINY_MODEL.append(DSV32Model(DSV32Config.tiny(), device="cpu", dtype=torch.float32))
    return _TINY_MODEL[0]


def _engine(*, shared_model: bool = True, **overrides) -> DecodeEngine:
    """An engine over the tiny YAML; ``shared_model=False`` builds the model the config asks for."""
    config = load_run_config(TINY_YAML, overrides)
    if not shared_model or config.model != load_run_config(TINY_YAML).model:
        return DecodeEngine(config)
    return DecodeEngine(config, model=_tiny_model())


def _yaml(tmp: Path, text: str) -> Callable[[], object]:
    def load() -> object:
        path = tmp / "bad.yaml"
        path.write_text(text)
        return load_run_config(path)

    return load


# ---- batch: what the door checks of test_bad_input.py do not already show ----------------------


def _plan(batch: ForwardBatch, **limits) -> Callable[[], object]:
    return lambda: Planner(["nsa", "paged"], _limits(**limits)).plan(batch)


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int32, device="meta")


BATCH_CASES = [
    Case(
        "token table on another device",
        "device",
        _plan(_good(req_to_token=_meta(16, MAX_CTX))),
        BatchError,
        "req_to_token",
        "wrong device",
        "planner/batch.py validate_batch",
    ),
    Case(
        "host lengths on a device",
        "device",
        _plan(_good(seq_lens_cpu=_meta(3))),
        BatchError,
        "seq_lens_cpu",
        "wrong device",
        "planner/batch.py validate_batch",
    ),
    Case(
        "out_cache_loc on another device",
        "device",
        _plan(_good(out_cache_loc=_meta(3))),
        BatchError,
        "out_cache_loc",
        "wrong device",
        "planner/batch.py validate_batch",
    ),
    Case(
        "CPU batch for a CUDA planner",
        "device",
        lambda: Planner(["nsa"], _limits(device="cuda:0")).plan(_good()),
        BatchError,
        "req_to_token",
        "expected cuda:0",
        "planner/batch.py validate_batch",
    ),
    Case(
        "NaN in a float tensor given as an index",
        "batch",
        _plan(_good(out_cache_loc=torch.tensor([1.0, float("nan"), 2.0]))),
        BatchError,
        "out_cache_loc",
        "int32 or torch.int64",
        "planner/batch.py validate_batch",
    ),
    Case(
        "lengths of dtype bool",
        "batch",
        _plan(_good(seq_lens_cpu=torch.ones(3, dtype=torch.bool))),
        BatchError,
        "seq_lens_cpu",
        "torch.int32",
        "planner/batch.py validate_batch",
    ),
    Case(
        "int64 slot past int32 (kv_slots set)",
        "batch",
        _plan(_good(out_cache_loc=torch.tensor([1, 2, 2**32 + 5]))),
        BatchError,
        "out_cache_loc",
        f"[0, {KV_SLOTS - 1}]",
        "planner/staging.py (host values, before any op)",
    ),
    Case(
        "int64 slot past int32 (no kv_slots)",
        "batch",
        _plan(_good(out_cache_loc=torch.tensor([1, 2, 2**32 + 5])), kv_slots=None),
        BatchError,
        "out_cache_loc",
        "2147483647",
        "planner/staging.py (host values, before any op)",
    ),
    Case(
        "int64 pool index past int32",
        "batch",
        _plan(_good(req_pool_indices=torch.tensor([1, 2, 2**40]))),
        BatchError,
        "req_pool_indices",
        "[0, 15]",
        "planner/staging.py (host values, before any op)",
    ),
    Case(
        "verify batch on a decode-only planner",
        "batch",
        _plan(
            random_batch(
                random.Random(1),
                TABLE,
                max_batch=4,
                max_context=MAX_CTX,
                next_n=2,
                mode=ForwardMode.TARGET_VERIFY,
            ),
            next_n=1,
        ),
        BatchError,
        "next_n",
        "expected 1",
        "planner/batch.py validate_batch",
    ),
    Case(
        "not a ForwardBatch",
        "batch",
        lambda: Planner(["paged"], _limits()).plan({"seq_lens_cpu": torch.ones(1)}),
        BatchError,
        "batch",
        "dict",
        "planner/batch.py validate_batch",
    ),
    Case(
        "pad_to below the batch",
        "batch",
        lambda: Planner(["paged"], _limits()).plan(_good(), pad_to=2),
        BatchError,
        "pad_to",
        "[3, 4]",
        "Planner.plan",
    ),
    Case(
        "capture size past max_batch",
        "batch",
        lambda: Planner(["paged"], _limits()).capture(5, req_to_token=TABLE),
        BatchError,
        "bs",
        "[1, 4]",
        "Planner.capture",
    ),
    Case(
        "capture over an int64 token table",
        "batch",
        lambda: Planner(["paged"], _limits()).capture(2, req_to_token=TABLE.long()),
        BatchError,
        "req_to_token",
        "torch.int32",
        "Planner.capture (validate_batch of the dummy batch)",
    ),
]


@pytest.fixture(autouse=True)
def _forget_deep_gemm():
    """A CUDA planner tries ``import deep_gemm`` once and remembers; leave no trace behind."""
    yield
    native.reset()


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: c.kind)
def test_bad_batch_refused_before_any_op(case, monkeypatch):
    launched: list[str] = []
    monkeypatch.setattr(Step, "run", lambda step, *a, **k: launched.append(step.key))
    _expect(case)
    assert launched == [], f"an op ran before the input was refused: {launched}"


def test_bad_batch_refused_at_replay_too(monkeypatch):
    """The same checks guard replay (no device reads there: all of these are host facts)."""
    planner = Planner(["nsa", "paged"], _limits())
    planner.capture(4, req_to_token=TABLE)
    launched: list[str] = []
    monkeypatch.setattr(Step, "run", lambda step, *a, **k: launched.append(step.key))
    for overrides, field in [
        (dict(req_to_token=_meta(16, MAX_CTX)), "req_to_token"),
        (dict(out_cache_loc=torch.tensor([1.0, float("nan"), 2.0])), "out_cache_loc"),
        (dict(out_cache_loc=torch.tensor([1, 2, 2**32 + 5])), "out_cache_loc"),
        (dict(seq_lens_cpu=torch.ones(3, dtype=torch.bool)), "seq_lens_cpu"),
    ]:
        with pytest.raises(BatchError) as info:
            planner.replay(_good(**overrides), 4)
        assert info.value.field == field
    assert launched == []


# ---- limits ------------------------------------------------------------------------------------

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


@pytest.mark.parametrize(("field", "bad", "limit"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_limits_name_the_field_and_the_limit(field, bad, limit):
    with pytest.raises(ValueError) as info:
        _limits(**bad)
    assert field in str(info.value) and limit in str(info.value)


@pytest.mark.parametrize(("field", "bad", "limit"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_limits_errors_are_config_errors(field, bad, limit):
    with pytest.raises(ConfigError) as info:
        _limits(**bad)
    assert info.value.field == field


# ---- configs: the YAML run config, the planner's own build, backends and providers ----------


def config_cases(tmp: Path) -> list[Case]:
    return [
        Case(
            "unknown key in a section",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_bacth": 8}),
            ConfigError,
            "planner.max_bacth",
            "Extra inputs are not permitted",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "unknown section",
            "config",
            lambda: load_run_config(TINY_YAML, {"plannr.max_batch": 8}),
            ConfigError,
            "plannr",
            "Extra inputs are not permitted",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "max_batch out of range",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_batch": 0}),
            ConfigError,
            "planner.max_batch",
            "greater than or equal to 1",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "max_context below one page",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_context": 32}),
            ConfigError,
            "planner.max_context",
            "greater than or equal to 64",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "max_context below the longest request",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_context": 64}),
            ConfigError,
            "planner.max_context",
            "below the longest request",
            "planner/run_config.py RunConfig.check_fits",
        ),
        Case(
            "next_n outside deep_gemm's 1 or 2 (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.next_n": 3}),
            ConfigError,
            "planner.next_n",
            "1 or 2",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "NaN arrival rate",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.arrival_rate": float("nan")}),
            ConfigError,
            "loop.arrival_rate",
            "greater than 0",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "reversed range",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.prompt_len": [40, 8]}),
            ConfigError,
            "loop.prompt_len",
            "must be [lo, hi]",
            "planner/run_config.py LoopSection._range",
        ),
        Case(
            "unknown schedule layout (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.schedule_layout": "0.2"}),
            ConfigError,
            "planner.schedule_layout",
            "'0.1.0' or 'new'",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "unknown model dtype",
            "config",
            lambda: load_run_config(TINY_YAML, {"model.dtype": "fp8"}),
            ConfigError,
            "model.dtype",
            "'float32' or 'bfloat16'",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "not YAML",
            "config",
            _yaml(tmp, "planner: [1\n"),
            ConfigError,
            "--config",
            "not valid YAML",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "YAML that is not a mapping",
            "config",
            _yaml(tmp, "- planner\n"),
            ConfigError,
            "<root>",
            "top level must be a mapping",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "missing config file",
            "config",
            lambda: load_run_config(tmp / "nowhere.yaml"),
            ConfigError,
            "--config",
            "No such file",
            "planner/run_config.py load_run_config",
        ),
        Case(
            "unknown model preset",
            "config",
            lambda: _engine(**{"model.preset": "huge"}),
            ConfigError,
            "model.preset",
            "'tiny'",
            "planner/serving/engine.py model_config",
        ),
        Case(
            "unknown provider for an op (YAML)",
            "provider",
            lambda: _engine(**{"planner.providers": {"page_table": "cutlass"}}),
            ProviderError,
            "page_table",
            "['torch', 'triton']",
            "planner/ops.py MetadataOp.select (Planner build)",
        ),
        Case(
            "provider for an op no field uses",
            "provider",
            lambda: _engine(**{"planner.providers": {"pages_per_requst": "torch"}}),
            SchemaError,
            "providers",
            "paged_mqa_schedule",
            "Planner._check_forced_keys",
        ),
        Case(
            "forced provider unavailable here",
            "provider",
            lambda: _engine(**{"planner.providers": {"paged_mqa_schedule": "deep_gemm"}}),
            ProviderError,
            "paged_mqa_schedule",
            "not available on cpu",
            "planner/ops.py MetadataOp.select (Planner build)",
        ),
        Case(
            "capture size past max_batch (YAML)",
            "config",
            lambda: _engine(**{"graphs.sizes": [1, 32]}),
            ConfigError,
            "capture_sizes",
            "<= 16",
            "graphs/sizes.py capture_ladder (GraphRunner build)",
        ),
        Case(
            "unknown backend",
            "backend",
            lambda: Planner(["nsa", "flashattention"], _limits()),
            SchemaError,
            "backend",
            "'paged'",
            "planner/registry.py get_backend",
        ),
        Case(
            "no backend",
            "backend",
            lambda: Planner([], _limits()),
            SchemaError,
            "backends",
            "at least one backend",
            "Planner.__init__",
        ),
        Case(
            "options for a backend not planned",
            "backend",
            lambda: Planner(["nsa"], _limits(), options={"paged": {}}),
            SchemaError,
            "options",
            "['nsa']",
            "Planner.__init__",
        ),
        Case(
            "NSA over pages other than 64",
            "config",
            lambda: Planner(["nsa"], _limits(page_size=32)),
            SchemaError,
            "page_size",
            "expected 64",
            "backends/nsa.py NSAPlan.check_settings (Planner build)",
        ),
        Case(
            "NSA block_kv other than 64",
            "config",
            lambda: Planner(["nsa"], _limits(), options={"nsa": {"block_kv": 128}}),
            SchemaError,
            "nsa.block_kv",
            "expected 64",
            "backends/nsa.py NSAPlan.check_settings (Planner build)",
        ),
        Case(
            "NSA next_n outside deep_gemm's 1 or 2",
            "config",
            lambda: Planner(["nsa"], _limits(next_n=3)),
            SchemaError,
            "next_n",
            "(1, 2)",
            "backends/nsa.py NSAPlan.check_settings (Planner build)",
        ),
        Case(
            "NSA top-k NaN",
            "config",
            lambda: Planner(["nsa"], _limits(), options={"nsa": {"topk": float("nan")}}),
            SchemaError,
            "nsa.topk",
            ">= 1",
            "backends/nsa.py NSAPlan.check_settings (Planner build)",
        ),
        Case(
            "NSA schedule layout unknown",
            "config",
            lambda: Planner(["nsa"], _limits(), options={"nsa": {"schedule_layout": "0.2"}}),
            SchemaError,
            "nsa.schedule_layout",
            "'new'",
            "backends/nsa.py NSAPlan.check_settings (Planner build)",
        ),
        Case(
            "unknown graph mode",
            "config",
            lambda: GraphRunner(
                Planner(["paged"], _limits()), lambda i, p: i, req_to_token=TABLE, modes=["prefill"]
            ),
            ConfigError,
            "modes",
            "'target_verify'",
            "graphs/runner.py GraphRunner.__init__",
        ),
        Case(
            "dump env value not a count",
            "dump",
            lambda: DumpRing.from_env({"PLANNER_DUMP_DIR": str(tmp), "PLANNER_DUMP_KEEP": "0"}),
            ConfigError,
            "PLANNER_DUMP_KEEP",
            ">= 1",
            "planner/dump_ring.py DumpRing.from_env",
        ),
    ]


CONFIG_KINDS = [c.kind for c in config_cases(Path("/nonexistent"))]


@pytest.mark.parametrize("kind", CONFIG_KINDS)
def test_bad_config_refused_naming_the_field(kind, tmp_path, monkeypatch):
    launched: list[str] = []
    monkeypatch.setattr(Step, "run", lambda step, *a, **k: launched.append(step.key))
    (case,) = [c for c in config_cases(tmp_path) if c.kind == kind]
    _expect(case)
    assert launched == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_run_config_on_a_cpu_machine():
    with pytest.raises(ConfigError) as info:
        _engine(device="cuda")
    assert info.value.field == "device" and "not available" in str(info.value)


def test_plan_topk_other_than_the_models_is_refused_before_the_first_layer(monkeypatch):
    """A plan built for another model: the model refuses it before any layer runs."""
    model = _tiny_model()
    cache = model.new_cache(4 * MAX_CTX // PAGE + 1)
    table = make_pool(5, MAX_CTX, PAGE)
    planner = Planner(["nsa"], _limits(kv_slots=cache.num_slots), options={"nsa": {"topk": 2048}})
    batch = random_batch(random.Random(0), table, max_batch=4, max_context=MAX_CTX, bs=2)
    layers: list[int] = []
    original = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a: layers.append(1) or original(self, *a))
    with pytest.raises(PlanError) as info:
        model(torch.zeros(2, dtype=torch.int64), planner.plan(batch), cache)
    assert info.value.field == "topk" and "expected 16, got 2048" in str(info.value)
    assert layers == []


# ---- dumps -------------------------------------------------------------------------------------


@pytest.fixture
def dump_dir(tmp_path) -> Path:
    planner = Planner(["nsa", "paged"], _limits())
    return dump_plans(planner.plan(_good()), tmp_path / "dump", step=1)


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


@pytest.mark.parametrize("kind", sorted(DUMP_CASES))
def test_corrupt_dump_is_a_dump_error(dump_dir, kind):
    corrupt, message = DUMP_CASES[kind]
    corrupt(dump_dir)
    with pytest.raises(DumpError, match=message) as info:
        load_dump(dump_dir)
    if kind == "dump tensor bytes flipped":
        assert info.value.field.startswith("paged.")


# ---- the table in docs/reliability.md ----------------------------------------------------------


def test_every_kind_is_in_the_reliability_table():
    text = (REPO / "docs" / "reliability.md").read_text()
    kinds = [c.kind for c in BATCH_CASES] + CONFIG_KINDS + sorted(DUMP_CASES)
    kinds += [f"Limits.{field}" for field, _, _ in LIMIT_CASES]
    kinds += [x.kind for x in NOT_REFUSED]
    missing = [k for k in kinds if f"| {k} |" not in text]
    assert not missing, f"docs/reliability.md lacks rows for {missing}"


def _expect(case: Case) -> None:
    with pytest.raises(PlanError) as info:
        case.run()
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__}: {err}"
    assert err.field == case.field, str(err)
    assert case.field in str(err)
    if case.limit is not None:
        assert case.limit in str(err), str(err)


# ---- not refused today: each is a finding (see docs/reliability.md) ---------------------------


@dataclass(frozen=True)
class Finding:
    kind: str
    reason: str
    run: Callable[[Path], object]
    fields: tuple[str, ...]
    """``err.field`` values a fix may reasonably choose."""


def _table_with(value: int) -> torch.Tensor:
    table = TABLE.clone()
    table[_good().req_pool_indices[0], 0] = value
    return table


def _kv_pages_too_small(tmp: Path) -> object:
    engine = _engine(
        **{
            "loop.kv_pages": 2,
            "loop.requests": 2,
            "loop.prompt_len": [60, 60],
            "loop.max_new_tokens": [10, 10],
            "loop.max_steps": 30,
        }
    )
    return engine.run(progress=False)


def _missing_weights(tmp: Path) -> object:
    return _engine(**{"model.weights": str(tmp / "none.safetensors")})


def _debug_env(tmp: Path) -> object:
    import os

    old = os.environ.get("PLANNER_DEBUG")
    os.environ["PLANNER_DEBUG"] = "maybe"  # "true"/"yes"/"on" turn it on; a typo must not be "off"
    try:
        planner = Planner(["paged"], _limits())
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
        lambda tmp: Planner(["nsa", "paged"], _limits()).plan(
            _good(req_to_token=_table_with(10**6))
        ),
        ("req_to_token", "nsa.token_slots", "paged.token_slots"),
    ),
    Finding(
        "negative token table entry",
        "a slot of -5 becomes page id -1 in nsa.page_table (a negative index in the kernel)",
        lambda tmp: Planner(["nsa"], _limits()).plan(_good(req_to_token=_table_with(-5))),
        ("req_to_token", "nsa.token_slots"),
    ),
    Finding(
        "two tokens writing one KV slot",
        "duplicate out_cache_loc entries are accepted; two rows then write the same slot",
        lambda tmp: Planner(["nsa"], _limits()).plan(
            _good(out_cache_loc=torch.tensor([300, 300, 301], dtype=torch.int32))
        ),
        ("out_cache_loc",),
    ),
    Finding(
        "positions disagreeing with lengths",
        "positions are range-checked only; a decode token at position 0 of a 100-token request "
        "gets the wrong rope silently",
        lambda tmp: Planner(["nsa"], _limits()).plan(
            _good(positions=torch.zeros(3, dtype=torch.int32))
        ),
        ("positions",),
    ),
    Finding(
        "unknown backend option",
        "options={'nsa': {'topkk': 5}} is merged into the settings and ignored, so the typo "
        "leaves top-k at its default",
        lambda tmp: Planner(["nsa"], _limits(), options={"nsa": {"topkk": 5}}),
        ("options", "nsa", "nsa.topkk"),
    ),
    Finding(
        "PLANNER_DEBUG=true",
        "only the exact value '1' enables debug mode; 'true', 'yes', 'on' silently leave it "
        "off (PLANNER_DUMP_* values are validated, this one is not)",
        _debug_env,
        ("PLANNER_DEBUG",),
    ),
    Finding(
        "model override of the page size",
        "model.overrides is validated by DSV32Config directly: page_size 32 raises a raw "
        "pydantic ValidationError from DecodeEngine, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"page_size": 32}}),
        ("model.overrides.page_size", "model.overrides", "page_size"),
    ),
    Finding(
        "unknown model override key",
        "a typo in model.overrides raises a raw pydantic ValidationError, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"index_topkk": 8}}),
        ("model.overrides.index_topkk", "model.overrides", "index_topkk"),
    ),
    Finding(
        "NaN model override",
        "model.overrides rope_theta NaN raises a raw pydantic ValidationError, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"rope_theta": float("nan")}}),
        ("model.overrides.rope_theta", "model.overrides", "rope_theta"),
    ),
    Finding(
        "context past the model's positions",
        "planner.max_context 256 over a model with max_position_embeddings 128 is accepted",
        lambda tmp: _engine(**{"model.overrides": {"max_position_embeddings": 128}}),
        ("planner.max_context", "max_position_embeddings", "model.overrides"),
    ),
    Finding(
        "missing weights file",
        "model.weights naming a missing file raises a raw FileNotFoundError from safetensors",
        _missing_weights,
        ("model.weights",),
    ),
    Finding(
        "device name torch does not know",
        "device: tpu passes RunConfig and raises a raw RuntimeError from torch.device in "
        "DecodeEngine",
        lambda tmp: _engine(device="tpu"),
        ("device",),
    ),
    Finding(
        "KV cache smaller than one request",
        "loop.kv_pages 2 (one usable page) cannot hold a 71-token request: it is never "
        "admitted and the loop spins to max_steps, returning no tokens and no error",
        _kv_pages_too_small,
        ("loop.kv_pages",),
    ),
    Finding(
        "config error on the root",
        "max_context below the longest request is a ConfigError whose field is '<root>' (the "
        "message names planner.max_context); reversed ranges say 'loop', not 'loop.prompt_len'",
        lambda tmp: load_run_config(TINY_YAML, {"planner.max_context": 64}),
        ("planner.max_context",),
    ),
]

if not torch.cuda.is_available():
    NOT_REFUSED.append(
        Finding(
            "CUDA planner without CUDA",
            "Limits(device='cuda') builds, then Planner() raises torch's raw AssertionError "
            "('Torch not compiled with CUDA enabled') from Limits.torch_device",
            lambda tmp: Planner(["paged"], _limits(device="cuda")),
            ("device",),
        )
    )


FIXED = {
    "unknown backend option",
    "PLANNER_DEBUG=true",
    "model override of the page size",
    "unknown model override key",
    "NaN model override",
    "context past the model's positions",
    "missing weights file",
    "device name torch does not know",
    "KV cache smaller than one request",
    "config error on the root",
    "CUDA planner without CUDA",
}
"""Findings of this catalogue that the planner now refuses (they stay here as regression tests)."""


@pytest.mark.parametrize(
    "finding",
    [
        f
        if f.kind in FIXED
        else pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=f.reason))
        for f in NOT_REFUSED
    ],
    ids=[f.kind for f in NOT_REFUSED],
)
def test_not_refused_today(finding, tmp_path):
    with pytest.raises(PlanError) as info:
        finding.run(tmp_path)
    assert info.value.field in finding.fields, str(info.value)


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("On", True), ("0", False), ("no", False), ("", False)],
)
def test_planner_debug_env_values(value, on, monkeypatch):
    monkeypatch.setenv("PLANNER_DEBUG", value)
    assert Planner(["paged"], _limits()).debug is on
