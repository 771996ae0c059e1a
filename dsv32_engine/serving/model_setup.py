"""What a run config builds before the loop starts: the device, the model config, the model.

Kept apart from the engine so the one place that turns a preset name, a
``config.json`` or a weights file into a model is easy to find and to test,
and every refusal names the config field to change.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from dsv32_engine.models.config import PRESETS, DSV32Config
from dsv32_engine.models.hf_config import from_hf_config_json
from dsv32_engine.models.kv_cache import cache_bytes, pages_for
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import mtp_config
from dsv32_engine.serving.run_config import ModelSection, RunConfig
from planner.errors import ConfigError


def model_config(section: ModelSection) -> DSV32Config:
    """The model config a run asks for: a preset or a config.json, then overrides."""
    if section.preset in PRESETS:
        base = DSV32Config.preset(section.preset)
    elif Path(section.preset).is_file():
        base = from_hf_config_json(section.preset)
    else:
        raise ConfigError(
            "unknown model preset and no such config.json",
            field="model.preset",
            expected=list(PRESETS),
            actual=section.preset,
        )
    if not section.overrides:
        return base
    unknown = sorted(set(section.overrides) - set(DSV32Config.model_fields))
    if unknown:
        raise ConfigError(
            "unknown model field",
            field=f"model.overrides.{unknown[0]}",
            expected="a DSV32Config field",
        )
    try:
        return DSV32Config.model_validate({**base.model_dump(), **section.overrides})
    except (ValidationError, ConfigError) as exc:
        if isinstance(exc, ConfigError):
            raise ConfigError(str(exc), field=f"model.overrides.{exc.field}") from None
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            first["msg"], field=f"model.overrides.{where}", actual=first.get("input")
        ) from None


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA requested but not available here", field="device", actual=name)
    return device


def build_model(config: RunConfig, model_cfg: DSV32Config, device: torch.device) -> DSV32Model:
    """The run's model: loaded from ``model.weights``, else random from ``model.seed``."""
    if config.planner.max_context > model_cfg.max_position_embeddings:
        raise ConfigError(
            "longer than the model's positions",
            field="planner.max_context",
            expected=f"<= {model_cfg.max_position_embeddings} (max_position_embeddings)",
            actual=config.planner.max_context,
        )
    weights = config.model.weights
    dtype = model_dtype(config)
    if weights and not Path(weights).is_file():
        raise ConfigError("no such weights file", field="model.weights", actual=weights)
    if weights:
        try:
            stored, meta = DSV32Model.read_config(weights)
            check_weights_match(weights, stored, meta, model_cfg, dtype)
            return DSV32Model.from_file(weights, device=device)
        except ConfigError as exc:
            if exc.field == "model.weights":
                raise
            raise ConfigError(
                exc.message + " (model.weights / --load-weights)",
                field="model.weights",
                expected=exc.expected,
                actual=exc.actual,
            ) from None
    return DSV32Model(model_cfg, seed=config.model.seed, device=device, dtype=dtype)


def max_kv_pages(config: RunConfig, model_cfg: DSV32Config) -> int:
    """The most KV pages a run uses (page 0 included): ``max_batch`` requests of
    ``max_context``. The CPU allocates this many; a GPU no more than fit its memory."""
    per_request = pages_for(config.planner.max_context, model_cfg.page_size)
    return config.planner.max_batch * per_request + 1


def kv_page_bytes(config: RunConfig, model_cfg: DSV32Config, dtype: torch.dtype) -> int:
    """Device bytes one page costs: every layer's MLA and index caches in the model's
    ``dtype``, plus the MTP draft's one layer when the run drafts with it (its cache has the
    same pages)."""
    per_page = cache_bytes(model_cfg, 1, dtype)
    if config.speculative.draft == "mtp":
        per_page += cache_bytes(mtp_config(model_cfg), 1, dtype)
    return per_page


def model_dtype(config: RunConfig) -> torch.dtype:
    """The torch dtype of ``model.dtype``."""
    return torch.float32 if config.model.dtype == "float32" else torch.bfloat16


def kv_pages(config: RunConfig, model: DSV32Model, device: torch.device) -> int:
    """KV (and index-cache) pages for the run, page 0 (the null page) included.

    Given (``loop.kv_pages``) it is used as is; on the CPU enough for every
    request at ``max_context``; on a GPU as many as fit in ``kv_memory_fraction``
    of the memory free after the weights, less ``graph_reserve_mb`` for graph
    pools and activations, but never more than that maximum. An MTP draft keeps
    a cache of the same pages for its one layer, so a page costs one layer more.
    Refused when not one request of ``max_context`` fits: the run could never
    serve it.
    """
    loop, planner = config.loop, config.planner
    page = model.config.page_size
    per_request = pages_for(planner.max_context, page)
    wanted = max_kv_pages(config, model.config)
    if loop.kv_pages is not None:
        return loop.kv_pages
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * loop.kv_memory_fraction) - (loop.graph_reserve_mb << 20)
    per_page = kv_page_bytes(config, model.config, model.dtype)
    fits = max(0, budget // per_page)
    if fits - 1 < per_request:
        raise ConfigError(
            f"the KV cache cannot hold one request of max_context: {max(fits - 1, 0) * page} "
            f"tokens fit in {budget / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free after the "
            f"weights); lower planner.max_context, raise loop.kv_memory_fraction, or use a "
            f"smaller model",
            field="planner.max_context",
            expected=f"<= {max(fits - 1, 0) * page}",
            actual=planner.max_context,
        )
    return min(wanted, fits)


def check_weights_match(
    path: str, stored: DSV32Config, meta: dict[str, str], wanted: DSV32Config, dtype: torch.dtype
) -> None:
    """A weights file replaces the configured model only if it holds that very model: the
    first differing config field (or the dtype) is named, with both values."""
    a, b = stored.model_dump(), wanted.model_dump()
    differ = [k for k in b if a.get(k) != b[k]]
    if differ:
        first = differ[0]
        more = f" (and {len(differ) - 1} more: {', '.join(differ[1:])})" if differ[1:] else ""
        raise ConfigError(
            f"{path} holds another model than the configured one: {first} differs{more}; "
            "set model.preset / model.overrides to the file's model, or load another file",
            field="model.weights",
            expected=f"{first}={b[first]!r} (configured)",
            actual=f"{first}={a[first]!r} (in the file)",
        )
    stored_dtype = meta.get("dtype", "torch.bfloat16").removeprefix("torch.")
    if stored_dtype != str(dtype).removeprefix("torch."):
        raise ConfigError(
            f"{path} holds {stored_dtype} weights, the config asks for another dtype",
            field="model.weights",
            expected=f"model.dtype={str(dtype).removeprefix('torch.')!r} (configured)",
            actual=f"{stored_dtype!r} (in the file)",
        )
