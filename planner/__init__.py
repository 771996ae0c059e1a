"""forward-planner: attention metadata planned once per forward batch, CUDA-graph aware."""

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
from planner.planner import Planner, PlanSet
from planner.registry import all_backends, get_backend
from planner.schema import PAD_DERIVED, Plan, Setting, Tensor, scalar_field, tensor_field

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
