"""Lightning indexer: chooses which cached tokens each query row attends to.

Per row it projects small multi-head queries from the MLA query latent and
one key from the hidden state, rotates both (rope, then Hadamard), quantises
them to fp8 and lets the backend score every cached token:
``score[t] = k_scale[t] * sum_h w_h relu(q_h . k_t)``, keeping the top-k.
The key is written to the index cache before scoring so a token can select
itself. Lengths, slots and schedules come from the plan.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.common.triton_kernels import triton_available
from backends.deepgemm import fp8
from backends.deepgemm.fp8_triton import quantize_fp8_triton, quantize_fp8_weighted_triton
from backends.nsa import NSAExtendPlan, NSAPlan
from backends.nsa.attention import indexer_topk
from backends.nsa.extend_attention import indexer_topk_extend
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers import bf16_terms
from dsv32_engine.models.layers.bf16_terms import Bf16TermsProjection, mm_fp32_out_available
from dsv32_engine.models.layers.exact import Linear, invariant
from dsv32_engine.models.layers.hadamard import hadamard_matrix, hadamard_rotate
from dsv32_engine.models.layers.invariant_gemm import invariant_linear
from dsv32_engine.models.layers.norm import LayerNorm
from dsv32_engine.models.layers.rope import apply_rope_half_leading


class Indexer(nn.Module):
    """Query/key projections of the indexer plus the fp8 top-k call."""

    batch_invariant: bool = False
    """The batch-invariant mode (``exact.set_batch_invariant``): ``weights_proj`` takes one
    path whatever the row count (see ``_head_weights``)."""

    def __init__(self, cfg: DSV32Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim)
        # fp32: the head weights multiply every relu'd dot product in the ranking.
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        self._terms: Bf16TermsProjection | None = None
        # Filled by reset_buffers: built empty so construction on "meta" stays cheap.
        self.register_buffer(
            "hadamard", torch.empty(self.head_dim, self.head_dim), persistent=False
        )
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Refill non-persistent buffers (at construction and after ``to_empty``)."""
        if self.hadamard.device.type != "meta":
            self.hadamard.copy_(hadamard_matrix(self.head_dim, device=self.hadamard.device))

    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on the leading ``rope_dim`` features (half-split pairs), rest untouched."""
        return apply_rope_half_leading(x, cos, sin, self.rope_dim)

    def project(
        self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated float ``q [rows, H, D]``, ``k [rows, D]`` and head weights ``[rows, H]``.

        The weights include ``H^-0.5 * D^-0.5`` but not the fp8 query scale, so
        ``sum_h w_h relu(q_h . k)`` is the unquantised score (the test reference).
        """
        q, k, w = self.project_roped(x, qr, cos, sin)
        return self._rotate(q).to(x.dtype), self._rotate(k).to(x.dtype), w

    def project_roped(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_proj: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project`` before the Hadamard rotation: roped ``q``, ``k``, and the weights
        (``k_proj``: ``wk(x)`` when the layer's fused input projection computed it)."""
        rows = x.shape[0]
        q = self._rope_first(self.wq_b(qr).view(rows, self.n_heads, self.head_dim), cos, sin)
        # The norm takes the rope as an argument: on CUDA the two are one launch.
        k_in = self.wk(x) if k_proj is None else k_proj
        k = self.k_norm(k_in, (cos, sin, self.rope_dim))
        w = self._head_weights(x) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, k, w

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``weights_proj(x)`` in fp32 from fp32 weights. On CUDA with bf16 activations and at
        least ``MIN_ROWS`` rows, one bf16 tensor-core GEMM over the weight's exact bf16 terms
        (``bf16_terms``) instead of a cast, cuBLAS's SIMT fp32 GEMM and its split-K
        reduction.

        In the batch-invariant mode on CUDA: always ``invariant_gemm``'s kernel, the bf16
        activations widened in registers against the fp32 weight (IEEE fp32 products and
        sums), whatever the row count (the two paths above round differently, so a decode of
        8 rows and its verify of 32 would rank differently)."""
        weight = self.weights_proj.weight
        if invariant(self.batch_invariant, x, weight):
            return invariant_linear(x, weight, self.weights_proj.bias, out_dtype=torch.float32)
        terms = x.shape[0] >= bf16_terms.MIN_ROWS and x.dtype == torch.bfloat16
        if terms and x.is_cuda and mm_fp32_out_available(x.device):
            if self._terms is None:
                self._terms = Bf16TermsProjection(self.weights_proj)
            return self._terms(x)
        return self.weights_proj(x.float())

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_rotate(x, self.hadamard)

    def _fused_kernels(self, x: torch.Tensor) -> bool:
        """Whether the rotation, quantisation and what consumes their output (the cache
        write, the query-scaled weights) run as single Triton launches: CUDA bf16 only,
        the CPU keeps its float64 torch path."""
        return x.is_cuda and x.dtype == torch.bfloat16 and triton_available(x.device)

    def rotate_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 codes and per-vector scales of ``bf16(rotate(x))``.

        On CUDA with bf16 activations this is one Triton launch (the rotation as a
        tensor-core dot inside the quantisation kernel), where the torch path takes an
        fp32 cast, an fp32 GEMM, a scale, a cast and the quantisation: two of each a layer.
        The products are exact and both sum in fp32, so results agree whenever those sums
        are exact (tests/gpu/test_fp8_triton_gpu.py counts any that do not).
        """
        if self._fused_kernels(x):
            return quantize_fp8_triton(
                x, self.head_dim, rotation=self.hadamard, rotation_scale=self.head_dim**-0.5
            )
        return fp8.quantize_fp8_e4m3_per_vector(self._rotate(x).to(x.dtype), block=self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        index_cache: torch.Tensor,
        k_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's keys, then return ``topk_slots int32 [rows, topk]`` (-1 invalid)."""
        q, k, w = self.project_roped(x, qr, cos, sin, k_proj)
        # One fp8 scale per head vector (the 128-element block in the real model).
        if self._fused_kernels(k) and self._fused_kernels(q):
            # The key's rotation, quantisation and cache store in one launch, and the query's
            # with its scale folded into the head weights in another: the same bytes as the
            # path below, in two launches where it takes about ten.
            rotation = {"rotation": self.hadamard, "rotation_scale": self.head_dim**-0.5}
            fp8.quantize_into_index_cache(index_cache, plan.out_cache_loc, k, **rotation)
            q_fp8, _, weights = quantize_fp8_weighted_triton(q, w, **rotation)
        else:
            k_fp8, k_scale = self.rotate_quantize(k)
            fp8.write_index_cache(index_cache, plan.out_cache_loc, k_fp8, k_scale)
            q_fp8, q_scale = self.rotate_quantize(q)
            weights = w * q_scale.squeeze(-1)
        if isinstance(plan, NSAExtendPlan):
            return indexer_topk_extend(plan, q_fp8, weights, index_cache)
        return indexer_topk(plan, q_fp8, weights, index_cache)
