"""CUDA graph capture and replay over planned batches, and an emulation that runs on the CPU.

``GraphRunner`` captures the model step per batch size (``capture_ladder``),
largest first into one pool, and replays it after the planner refreshed the
plans in place (``PulledTransport``: its graphs pull the staged inputs themselves, so a
replay makes no CUDA call); ``EmulatedGraph`` stands in for ``torch.cuda.CUDAGraph`` so
every phase and all padding logic are tested without a GPU, its capture refusing what a
real one would not survive (``CaptureGuard``: host syncs, data-dependent shapes).
"""

from graphs.capture_guard import CaptureGuard
from graphs.emulated import EmulatedGraph, EmulatedPool
from graphs.graph import CudaGraph, Graph, is_capturing, new_graph, new_pool
from graphs.inputs import InputSpec, StaticInputs
from graphs.outputs import GraphOutputError
from graphs.runner import (
    BATCH_TOO_LARGE,
    GRAPHS_DISABLED,
    MODE_NOT_CAPTURED,
    RAGGED,
    SIZE_DROPPED,
    GraphRunner,
    GraphWarning,
)
from graphs.sizes import capture_ladder, default_capture_ladder
from graphs.staging_pull import PulledTransport
from graphs.stats import GraphStats
from planner.errors import GraphSafetyError

__all__ = [
    "BATCH_TOO_LARGE",
    "GRAPHS_DISABLED",
    "MODE_NOT_CAPTURED",
    "RAGGED",
    "SIZE_DROPPED",
    "CaptureGuard",
    "CudaGraph",
    "EmulatedGraph",
    "EmulatedPool",
    "Graph",
    "GraphOutputError",
    "GraphRunner",
    "GraphSafetyError",
    "GraphStats",
    "GraphWarning",
    "InputSpec",
    "PulledTransport",
    "StaticInputs",
    "capture_ladder",
    "default_capture_ladder",
    "is_capturing",
    "new_graph",
    "new_pool",
]
