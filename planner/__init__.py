"""forward-planner: attention metadata planned once per forward batch, CUDA-graph aware.

The public names are imported on first use (PEP 562): ``from planner import Planner``
works as always, while ``import planner.errors`` (what ``python -m planner --help``
needs) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.batch import ForwardBatch, ForwardMode
    from planner.errors import (
        BatchError,
        ConfigError,
        DumpError,
        PlanError,
        PlanWriteError,
        ProviderError,
        ReplayError,
        SchemaError,
    )
    from planner.limits import Limits
    from planner.ops import MetadataOp, get_op, metadata_op
    from planner.planner import Planner
    from planner.plans import PlanSet
    from planner.registry import all_backends, get_backend
    from planner.schema import PAD_DERIVED, Plan, Setting, Tensor, scalar_field, tensor_field

_EXPORTS = {
    "PAD_DERIVED": "planner.schema:PAD_DERIVED",
    "BatchError": "planner.errors:BatchError",
    "ConfigError": "planner.errors:ConfigError",
    "DumpError": "planner.errors:DumpError",
    "ForwardBatch": "planner.batch:ForwardBatch",
    "ForwardMode": "planner.batch:ForwardMode",
    "Limits": "planner.limits:Limits",
    "MetadataOp": "planner.ops:MetadataOp",
    "Plan": "planner.schema:Plan",
    "PlanError": "planner.errors:PlanError",
    "PlanSet": "planner.plans:PlanSet",
    "PlanWriteError": "planner.errors:PlanWriteError",
    "Planner": "planner.planner:Planner",
    "ProviderError": "planner.errors:ProviderError",
    "ReplayError": "planner.errors:ReplayError",
    "SchemaError": "planner.errors:SchemaError",
    "Setting": "planner.schema:Setting",
    "Tensor": "planner.schema:Tensor",
    "all_backends": "planner.registry:all_backends",
    "get_backend": "planner.registry:get_backend",
    "get_op": "planner.ops:get_op",
    "metadata_op": "planner.ops:metadata_op",
    "scalar_field": "planner.schema:scalar_field",
    "tensor_field": "planner.schema:tensor_field",
}
"""Each public name and where it lives (``module:name``)."""

__all__ = [
    "PAD_DERIVED",
    "BatchError",
    "ConfigError",
    "DumpError",
    "ForwardBatch",
    "ForwardMode",
    "Limits",
    "MetadataOp",
    "Plan",
    "PlanError",
    "PlanSet",
    "PlanWriteError",
    "Planner",
    "ProviderError",
    "ReplayError",
    "SchemaError",
    "Setting",
    "Tensor",
    "all_backends",
    "get_backend",
    "get_op",
    "metadata_op",
    "scalar_field",
    "tensor_field",
]


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
