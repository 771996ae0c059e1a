"""FlashInfer backends: paged decode (MHA/GQA) and DeepSeek MLA, planned once per batch.

Importing this package registers two plan schemas (``flashinfer_decode``,
``flashinfer_mla``), their device metadata ops (torch references and Triton
kernels) and the ``flashinfer_plan`` host op. It never imports ``flashinfer``
itself: the package is loaded on the first plan that uses it, so the planner's
registry (which imports every in-tree backend) works on any CPU.

Layers call :func:`flashinfer_decode_attention` / :func:`flashinfer_mla_attention`
with the plan: FlashInfer's ``run`` where a wrapper was planned, the torch
reference over the same plan fields otherwise.
"""

from backends.flashinfer.attention import (
    flashinfer_decode_attention,
    flashinfer_mla_attention,
    reference_decode_attention,
    reference_mla_attention,
)
from backends.flashinfer.plans import FlashInferDecodePlan, FlashInferMLAPlan
from backends.flashinfer.wrappers import flashinfer_importable, release_wrappers

__all__ = [
    "FlashInferDecodePlan",
    "FlashInferMLAPlan",
    "flashinfer_decode_attention",
    "flashinfer_importable",
    "flashinfer_mla_attention",
    "reference_decode_attention",
    "reference_mla_attention",
    "release_wrappers",
]
