"""Ragged graphs and mixing by default where graphs run on CUDA (issue 55), resolved from the
config alone: ``graphs.ragged`` and ``loop.mixed`` are ``auto`` unless set."""

from __future__ import annotations

import pytest

from dsv32_engine.serving.engine_settings import ragged_kv_bound
from dsv32_engine.serving.run_config import load_run_config
from planner import ConfigError


def _config(**overrides):
    return load_run_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "ragged", "mixed"),
    [
        ({}, False, False),  # the CPU: an emulated replay re-runs the padded forward
        ({"device": "cuda"}, True, True),
        ({"device": "cuda", "graphs.enabled": False}, False, False),
        ({"device": "cuda", "speculative.draft": "ngram"}, True, True),  # verify rows mix
        ({"speculative.draft": "mtp"}, False, False),  # the CPU, speculating or not
        ({"device": "cuda", "graphs.ragged": False}, False, True),  # mixed, eagerly
        ({"graphs.ragged": True}, True, False),  # each set by hand on the CPU
        ({"loop.mixed": True}, False, True),
    ],
)
def test_auto_turns_both_on_where_graphs_run_on_cuda(overrides, ragged, mixed):
    config = _config(**overrides)
    assert (config.ragged_graphs, config.mixes) == (ragged, mixed)


def test_a_mixed_step_budget_below_max_batch_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        _config(**{"loop.mixed": True, "loop.chunk_tokens": 15, "planner.max_batch": 16})
    assert err.value.field == "loop.chunk_tokens" and "max_batch" in str(err.value)
    _config(**{"loop.mixed": False, "loop.chunk_tokens": 15, "planner.max_batch": 16})


@pytest.mark.parametrize("draft_tokens", [2, 4, 8])
def test_a_speculating_mixed_budget_holds_every_verify_row_and_a_prompt_token(draft_tokens):
    """Speculating, each decoding request takes ``draft_tokens`` rows of a mixed step: the
    budget must leave a prompt beside ``max_batch - 1`` verifying requests one token."""
    least = 15 * draft_tokens + 1
    spec = {
        "speculative.draft": "ngram",
        "speculative.draft_tokens": draft_tokens,
        "planner.max_batch": 16,
        "loop.mixed": True,
    }
    with pytest.raises(ConfigError) as err:
        _config(**spec, **{"loop.chunk_tokens": least - 1})
    assert err.value.field == "loop.chunk_tokens"
    assert f">= {least}" in str(err.value) and "speculative.draft_tokens" in str(err.value)
    assert _config(**spec, **{"loop.chunk_tokens": least}).mixes
    _config(**{**spec, "loop.mixed": False}, **{"loop.chunk_tokens": least - 1})  # not mixing


def test_the_ragged_kv_bound_follows_the_cache_unless_set():
    planner = _config(**{"planner.max_batch": 4, "planner.max_context": 128}).planner
    assert ragged_kv_bound(planner, kv_slots=100) == 100  # the cache holds less
    assert ragged_kv_bound(planner, kv_slots=10_000) == 4 * 128  # no batch holds more
    stated = _config(**{"planner.ragged_kv_tokens": 7}).planner
    assert ragged_kv_bound(stated, kv_slots=100) == 7


def test_the_summary_says_why():
    from dsv32_engine.serving.report import _fast_paths_reason

    assert _fast_paths_reason(_config()) == "auto: on where graphs run on CUDA"
    assert _fast_paths_reason(_config(**{"graphs.ragged": True, "loop.mixed": False})) == "as set"
    assert _fast_paths_reason(_config(**{"loop.mixed": True})).startswith("graphs.ragged auto")
