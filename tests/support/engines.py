"""Decode engines over the tiny DeepSeek-V3.2 run config, and the one tiny model they may share."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from tests.support import TINY_YAML

SMALL_LOOP = {
    "loop.requests": 6,
    "loop.prompt_len": [3, 10],
    "loop.max_new_tokens": [4, 9],
    "loop.arrival_rate": 2.0,
    "planner.max_batch": 4,
    "planner.max_context": 128,
}
"""A short tiny-model loop (six requests, batches of up to four): what a test of the engine's
own paths serves."""


@cache
def tiny_model() -> DSV32Model:
    """The tiny preset in float32 on the CPU (seed 0), built once per session (~0.7 s)."""
    return DSV32Model(DSV32Config.tiny(), device="cpu", dtype=torch.float32)


def tiny_engine(overrides: Mapping[str, Any] | None = None, *, share_model: bool = False):
    """A ``DecodeEngine`` over ``configs/dsv32-tiny.yaml`` with run-config ``overrides``.

    ``share_model`` serves it with :func:`tiny_model` when the config asks for that very
    model (the YAML's own model section); otherwise the engine builds the model it asks for.
    """
    config = load_run_config(TINY_YAML, dict(overrides or {}))
    if share_model and config.model == load_run_config(TINY_YAML).model:
        return DecodeEngine(config, model=tiny_model())
    return DecodeEngine(config)
