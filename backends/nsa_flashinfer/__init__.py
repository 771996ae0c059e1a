"""NSA sparse MLA on FlashInfer's MLA kernel: a companion plan to ``nsa``, its host op
(FlashInfer's ``plan``, once per batch, skipped when the lengths repeat) and the attention
that reads it."""

from backends.nsa_flashinfer.attention import reference_sparse_mla, sparse_mla_flashinfer
from backends.nsa_flashinfer.plan import NSAFlashInferPlan
from backends.nsa_flashinfer.slots import SPARSE_POOL

__all__ = ["SPARSE_POOL", "NSAFlashInferPlan", "reference_sparse_mla", "sparse_mla_flashinfer"]
