"""DeepSeek-V3.2's Hugging Face ``config.json`` read into a validated :class:`DSV32Config`.

Keys that do not change the decode math are ignored; keys that would change it
to something this model does not implement are refused, naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsv32_engine.models.config import DSV32Config, YarnScaling
from planner.errors import ConfigError


def from_hf_config_json(path: str | Path) -> DSV32Config:
    """Read DeepSeek-V3.2's ``config.json``; raise ``ConfigError`` naming the field.

    Keys that do not change the decode math (token ids, dtype, quantisation,
    MTP layers) are ignored; keys that would change it to something this
    model does not implement (non-sigmoid scoring, non-YaRN rope) are refused.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}", field="config.json") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object", field="config.json")
    return from_hf_dict(raw, source=str(path))


def from_hf_dict(raw: dict[str, Any], *, source: str = "<dict>") -> DSV32Config:
    """The ``config.json`` mapping to a validated config (see ``from_hf_config_json``)."""
    fixed = (
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("norm_topk_prob", True),
        ("moe_layer_freq", 1),
        ("hidden_act", "silu"),
    )
    for key, allowed in fixed:
        if key in raw and raw[key] != allowed:
            raise ConfigError(
                f"{source}: unsupported {key}", field=key, expected=allowed, actual=raw[key]
            )
    names = set(DSV32Config.model_fields) - {"page_size", "moe_stand_in_dim"}
    missing = sorted(n for n in names - {"rope_scaling"} if n not in raw)
    if missing:
        raise ConfigError(f"{source}: missing keys {missing}", field=missing[0])
    kwargs = {n: raw[n] for n in names if n in raw}
    rs = raw.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict) or rs.get("type", rs.get("rope_type")) != "yarn":
            raise ConfigError(
                f"{source}: only YaRN rope scaling is supported",
                field="rope_scaling",
                expected="{'type': 'yarn', ...}",
                actual=rs,
            )
        known = set(YarnScaling.model_fields)
        kwargs["rope_scaling"] = {k: v for k, v in rs.items() if k in known}
    try:
        return DSV32Config(**kwargs)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"{source}: {e}",
            field=loc or "config",
            actual=first.get("input") if loc else None,
        ) from e
