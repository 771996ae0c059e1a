"""The bad-input catalogue's run-config part: what a run refuses as it builds itself.

Config kinds go through ``load_run_config``, ``DecodeEngine``, ``GraphRunner`` and
``DumpRing.from_env`` as a run builds them, and are refused with a ``PlanError`` subclass
(``ConfigError`` for configs and environment variables) naming the field and the limit,
before any metadata op has launched. The batches, limits, planner builds and dumps are in
``tests/planner/test_bad_input_catalogue.py``; the test at the end keeps both catalogues
and the table in ``docs/reliability.md`` in step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsv32_engine.serving.cli import DEFAULT_DECODE_CONFIG
from dsv32_engine.serving.dump_ring import DumpRing
from dsv32_engine.serving.memory_fit import Available, MemoryFitError, check_memory
from dsv32_engine.serving.run_config import load_run_config
from graphs import GraphRunner
from planner import ConfigError, ProviderError, SchemaError
from planner.debug import debug_from_env
from tests.planner import test_bad_input_catalogue as planner_catalogue
from tests.serving import test_cli_catalogue as cli_catalogue
from tests.support import REPO, TINY_YAML
from tests.support.catalogue import (
    NSA_PAGED_64,
    Case,
    Finding,
    expect_finding_refused,
    finding_params,
    refuse,
)
from tests.support.engines import tiny_engine


def _engine(**overrides):
    """An engine over the tiny YAML, on the session's tiny model where the config asks for it."""
    return tiny_engine(overrides, share_model=True)


def _yaml(tmp: Path, text: str) -> Callable[[], object]:
    def load() -> object:
        path = tmp / "bad.yaml"
        path.write_text(text)
        return load_run_config(path)

    return load


def _binary(tmp: Path) -> Callable[[], object]:
    def load() -> object:
        path = tmp / "binary.yaml"
        path.write_bytes(bytes(range(256)) * 4)  # not UTF-8
        return load_run_config(path)

    return load


def _not_blaming(path: Path, overrides: dict[str, object]) -> Callable[[], object]:
    """Load with ``overrides``; the refusal of an overridden value must not name the file
    (the value came from the caller: the CLI names its flag)."""

    def load() -> object:
        try:
            return load_run_config(path, overrides)
        except ConfigError as exc:
            assert str(path) not in str(exc) and path.name not in str(exc), str(exc)
            raise

    return load


LOAD = "dsv32_engine/serving/run_config.py load_run_config"


def config_cases(tmp: Path) -> list[Case]:
    return [
        Case(
            "unknown key in a section",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_bacth": 8}),
            ConfigError,
            "planner.max_bacth",
            "Extra inputs are not permitted",
            LOAD,
        ),
        Case(
            "unknown section",
            "config",
            lambda: load_run_config(TINY_YAML, {"plannr.max_batch": 8}),
            ConfigError,
            "plannr",
            "Extra inputs are not permitted",
            LOAD,
        ),
        Case(
            "max_batch out of range",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_batch": 0}),
            ConfigError,
            "planner.max_batch",
            "greater than or equal to 1",
            LOAD,
        ),
        Case(
            "max_context below one page",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_context": 32}),
            ConfigError,
            "planner.max_context",
            "greater than or equal to 64",
            LOAD,
        ),
        Case(
            "max_context below the longest request",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.max_context": 64}),
            ConfigError,
            "planner.max_context",
            "below the longest request",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "ragged_max_tokens not past max_batch",
            "config",
            lambda: load_run_config(
                TINY_YAML, {"graphs.ragged_max_tokens": 4, "planner.max_batch": 4}
            ),
            ConfigError,
            "graphs.ragged_max_tokens",
            "> 4 (planner.max_batch)",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "ragged_max_tokens beside a token ladder",
            "config",
            lambda: load_run_config(
                TINY_YAML, {"graphs.ragged_max_tokens": 64, "graphs.token_sizes": [32, 64]}
            ),
            ConfigError,
            "graphs.ragged_max_tokens",
            "unset with graphs.token_sizes",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "draft tokens outside 2..8 (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"speculative.draft_tokens": 9}),
            ConfigError,
            "speculative.draft_tokens",
            "less than or equal to 8",
            LOAD,
        ),
        Case(
            "draft steps other than draft tokens - 1",
            "config",
            lambda: load_run_config(
                TINY_YAML, {"speculative.draft_tokens": 4, "speculative.steps": 2}
            ),
            ConfigError,
            "speculative.steps",
            "expected 3",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "unknown draft kind",
            "config",
            lambda: load_run_config(TINY_YAML, {"speculative.draft": "eagle3"}),
            ConfigError,
            "speculative.draft",
            "'ngram'",
            LOAD,
        ),
        Case(
            "mixed step budget below the verify rows",
            "config",
            lambda: load_run_config(
                TINY_YAML,
                {"speculative.draft": "ngram", "loop.mixed": True, "loop.chunk_tokens": 60},
            ),
            ConfigError,
            "loop.chunk_tokens",
            ">= 61",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "n-gram window reversed",
            "config",
            lambda: load_run_config(
                TINY_YAML, {"speculative.ngram_min": 5, "speculative.ngram_max": 2}
            ),
            ConfigError,
            "speculative.ngram_min",
            "<= 2",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "verify rows set by planner.next_n (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.next_n": 2}),
            ConfigError,
            "planner.next_n",
            "speculative.draft_tokens",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "NaN arrival rate",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.arrival_rate": float("nan")}),
            ConfigError,
            "loop.arrival_rate",
            "greater than 0",
            LOAD,
        ),
        Case(
            "reversed range",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.prompt_len": [40, 8]}),
            ConfigError,
            "loop.prompt_len",
            "must be [lo, hi]",
            "dsv32_engine/serving/run_config.py LoopSection._range",
        ),
        Case(
            "unknown schedule layout (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"planner.schedule_layout": "0.2"}),
            ConfigError,
            "planner.schedule_layout",
            "'0.1.0' or 'new'",
            LOAD,
        ),
        Case(
            "unknown model dtype",
            "config",
            lambda: load_run_config(TINY_YAML, {"model.dtype": "fp8"}),
            ConfigError,
            "model.dtype",
            "'float32' or 'bfloat16'",
            LOAD,
        ),
        Case(
            "not YAML",
            "config",
            _yaml(tmp, "planner: [1\n"),
            ConfigError,
            "--config",
            "not valid YAML",
            LOAD,
        ),
        Case(
            "YAML syntax error names the file",
            "config",
            _yaml(tmp, "planner: [1\n"),
            ConfigError,
            "--config",
            'in "' + str(tmp / "bad.yaml") + '", line 1',
            LOAD,
        ),
        Case(
            "binary file as a config",
            "config",
            _binary(tmp),
            ConfigError,
            "--config",
            "not a text file",
            LOAD,
        ),
        Case(
            "bad YAML value names the file",
            "config",
            _yaml(tmp, "speculative:\n  draft_tokens: 9\n"),
            ConfigError,
            "speculative.draft_tokens",
            str(tmp / "bad.yaml") + ": Input should be less than or equal to 8",
            LOAD,
        ),
        Case(
            "bad override value does not blame the file",
            "config",
            _not_blaming(TINY_YAML, {"speculative.draft_tokens": 9}),
            ConfigError,
            "speculative.draft_tokens",
            "less than or equal to 8",
            "dsv32_engine/serving/run_config.py _format",
        ),
        Case(
            "YAML that is not a mapping",
            "config",
            _yaml(tmp, "- planner\n"),
            ConfigError,
            "<root>",
            "top level must be a mapping",
            LOAD,
        ),
        Case(
            "missing config file",
            "config",
            lambda: load_run_config(tmp / "nowhere.yaml"),
            ConfigError,
            "--config",
            "no such file, and no shipped config",
            LOAD,
        ),
        Case(
            "unknown model preset",
            "config",
            lambda: _engine(**{"model.preset": "huge"}),
            ConfigError,
            "model.preset",
            "'tiny'",
            "dsv32_engine/serving/model_setup.py model_config",
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
            "planner/program.py check_forced (Planner build)",
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
            "unknown graph mode",
            "config",
            lambda: GraphRunner(
                NSA_PAGED_64.planner(["paged"]),
                lambda i, p: i,
                req_to_token=NSA_PAGED_64.table,
                modes=["prefill"],
            ),
            ConfigError,
            "modes",
            "'target_verify'",
            "graphs/runner.py GraphRunner.__init__",
        ),
        Case(
            "debug env value not a boolean",
            "dump",
            lambda: debug_from_env({"PLANNER_DEBUG": "maybe"}),
            ConfigError,
            "PLANNER_DEBUG",
            "1/true/yes/on",
            "planner/debug.py debug_from_env",
        ),
        Case(
            "dump env value not a count",
            "dump",
            lambda: DumpRing.from_env({"PLANNER_DUMP_DIR": str(tmp), "PLANNER_DUMP_KEEP": "0"}),
            ConfigError,
            "PLANNER_DUMP_KEEP",
            ">= 1",
            "dsv32_engine/serving/dump_ring.py DumpRing.from_env",
        ),
        Case(
            "requests above their bound (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.requests": 100_001}),
            ConfigError,
            "loop.requests",
            "less than or equal to 100000",
            LOAD,
        ),
        Case(
            "max_steps above its bound (YAML)",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.max_steps": 1_000_001}),
            ConfigError,
            "loop.max_steps",
            "less than or equal to 1000000",
            LOAD,
        ),
        Case(
            "prompt length past the context bound",
            "config",
            lambda: load_run_config(TINY_YAML, {"loop.prompt_len": [8, 1 << 21]}),
            ConfigError,
            "loop.prompt_len",
            "<= 1,048,576",
            LOAD,
        ),
        Case(
            "workload prompt tokens above their bound",
            "config",
            lambda: load_run_config(
                TINY_YAML,
                {
                    "loop.requests": 100_000,
                    "loop.prompt_len": [8, 200],
                    "planner.max_context": 512,
                },
            ),
            ConfigError,
            "loop.requests",
            "<= 83886",
            "dsv32_engine/serving/run_config.py RunConfig.check_fits",
        ),
        Case(
            "config too big for the device's memory",
            "config",
            lambda: check_memory(
                load_run_config("dsv32-small", {"device": "cpu"}),
                available=Available(8 << 30, "a test's figure"),
            ),
            MemoryFitError,
            "loop.chunk_tokens",
            "8.0 GiB available",
            "dsv32_engine/serving/memory_fit.py check_memory",
        ),
        Case(
            "weights too big for the device's memory",
            "config",
            lambda: check_memory(
                load_run_config(TINY_YAML, {"model.preset": "full"}),
                available=Available(64 << 30, "a test's figure"),
            ),
            MemoryFitError,
            "model.preset",
            "the largest term is weights",
            "dsv32_engine/serving/memory_fit.py check_memory",
        ),
    ]


CONFIG_KINDS = [c.kind for c in config_cases(Path("/nonexistent"))]


@pytest.mark.parametrize("kind", CONFIG_KINDS)
def test_bad_config_refused_naming_the_field(kind, tmp_path, monkeypatch):
    (case,) = [c for c in config_cases(tmp_path) if c.kind == kind]
    assert refuse(case, "call", monkeypatch) == []


@pytest.mark.parametrize("text", ["", "# nothing set\n\n   # still nothing\n", "---\n"])
def test_an_empty_config_file_is_the_default_config(text, tmp_path):
    """An empty (or comments-only) file, and no file at all, run the default shipped config:
    the run config's defaults are what ``dsv32-tiny.yaml`` says (it keeps its keys, for the
    reader). They were not: 24 requests and 8,192 KV tokens instead of 32 and 4,096."""
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    default = load_run_config(DEFAULT_DECODE_CONFIG)
    assert load_run_config(path) == default
    assert load_run_config(None) == default
    assert default.loop.requests == 32 and default.planner.max_context == 256


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_run_config_on_a_cpu_machine():
    with pytest.raises(ConfigError) as info:
        _engine(device="cuda")
    assert info.value.field == "device" and "not available" in str(info.value)


# ---- not refused before: each was a finding (see docs/reliability.md) --------------------------


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


NOT_REFUSED = [
    Finding(
        "model override of the page size",
        "model.overrides is validated by DSV32Config directly: page_size 32 raises a raw "
        "pydantic ValidationError from DecodeEngine, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"page_size": 32}}),
        ("model.overrides.page_size", "model.overrides", "page_size"),
        fixed=True,
    ),
    Finding(
        "unknown model override key",
        "a typo in model.overrides raises a raw pydantic ValidationError, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"index_topkk": 8}}),
        ("model.overrides.index_topkk", "model.overrides", "index_topkk"),
        fixed=True,
    ),
    Finding(
        "NaN model override",
        "model.overrides rope_theta NaN raises a raw pydantic ValidationError, not a ConfigError",
        lambda tmp: _engine(**{"model.overrides": {"rope_theta": float("nan")}}),
        ("model.overrides.rope_theta", "model.overrides", "rope_theta"),
        fixed=True,
    ),
    Finding(
        "context past the model's positions",
        "planner.max_context 256 over a model with max_position_embeddings 128 is accepted",
        lambda tmp: _engine(**{"model.overrides": {"max_position_embeddings": 128}}),
        ("planner.max_context", "max_position_embeddings", "model.overrides"),
        fixed=True,
    ),
    Finding(
        "missing weights file",
        "model.weights naming a missing file raises a raw FileNotFoundError from safetensors",
        _missing_weights,
        ("model.weights",),
        fixed=True,
    ),
    Finding(
        "device name torch does not know",
        "device: tpu passes RunConfig and raises a raw RuntimeError from torch.device in "
        "DecodeEngine",
        lambda tmp: _engine(device="tpu"),
        ("device",),
        fixed=True,
    ),
    Finding(
        "KV cache smaller than one request",
        "loop.kv_pages 2 (one usable page) cannot hold a 71-token request: it is never "
        "admitted and the loop spins to max_steps, returning no tokens and no error",
        _kv_pages_too_small,
        ("loop.kv_pages",),
        fixed=True,
    ),
    Finding(
        "config error on the root",
        "max_context below the longest request is a ConfigError whose field is '<root>' (the "
        "message names planner.max_context); reversed ranges say 'loop', not 'loop.prompt_len'",
        lambda tmp: load_run_config(TINY_YAML, {"planner.max_context": 64}),
        ("planner.max_context",),
        fixed=True,
    ),
]
"""The run config's and the engine's findings; the planner's are in the planner catalogue."""


@pytest.mark.parametrize("finding", finding_params(NOT_REFUSED))
def test_not_refused_today(finding, tmp_path):
    expect_finding_refused(finding, tmp_path)


# ---- the table in docs/reliability.md ----------------------------------------------------------


def test_every_kind_is_in_the_reliability_table():
    text = (REPO / "docs" / "reliability.md").read_text()
    kinds = planner_catalogue.KINDS + CONFIG_KINDS + [f.kind for f in NOT_REFUSED]
    kinds += cli_catalogue.KINDS
    missing = [k for k in kinds if f"| {k} |" not in text]
    assert not missing, f"docs/reliability.md lacks rows for {missing}"


def _where_checked(text: str, kind: str) -> str:
    """The last cell (where checked) of the first table row of ``kind``."""
    row = next(line for line in text.splitlines() if line.startswith(f"| {kind} |"))
    return row.rstrip().removesuffix("|").rstrip().rsplit(" | ", 1)[-1]


def test_the_table_says_which_batch_kinds_the_device_check_refuses():
    """A batch kind's row names the device check where the catalogue's case is refused by it
    (at ``plan()``, and at the read after a replay's graph ran), and no other row does."""
    text = (REPO / "docs" / "reliability.md").read_text()
    device = planner_catalogue.DEVICE
    wrong = [
        (case.kind, _where_checked(text, case.kind))
        for case in planner_catalogue.BATCH_CASES
        if (_where_checked(text, case.kind) == device) != case.at_read
        or (case.at_read and case.where != device)
    ]
    assert not wrong, f"docs/reliability.md and the catalogue disagree on the device check: {wrong}"
    rows = [line for line in text.splitlines() if line.endswith(f"| {device} |")]
    assert len(rows) == sum(case.at_read for case in planner_catalogue.BATCH_CASES)
