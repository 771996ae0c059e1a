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

from backends.deepgemm import fp8
from backends.nsa import NSAExtendPlan, NSAPlan
from backends.nsa.attention import indexer_topk
from backends.nsa.extend_attention import indexer_topk_extend
from models.config import DSV32Config
from models.layers.exact import Linear
from models.layers.hadamard import hadamard_matrix, hadamard_rotate
from models.layers.norm import LayerNorm
from models.layers.rope import apply_rope_half_leading


class Indexer(nn.Module):
    """Query/key projections of the indexer plus the fp8 top-k call."""

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
        rows = x.shape[0]
        q = self.wq_b(qr).view(rows, self.n_heads, self.head_dim)
        q = hadamard_rotate(self._rope_first(q, cos, sin), self.hadamard).to(x.dtype)
        k = self.k_norm(self.wk(x))
        k = hadamard_rotate(self._rope_first(k, cos, sin), self.hadamard).to(x.dtype)
        w = self.weights_proj(x.float()) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, k, w

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        index_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's keys, then return ``topk_slots int32 [rows, topk]`` (-1 invalid)."""
        q, k, w = self.project(x, qr, cos, sin)
        # One fp8 scale per head vector (the 128-element block in the real model).
        k_fp8, k_scale = fp8.quantize_fp8_e4m3_per_vector(k, block=self.head_dim)
        fp8.write_index_cache(index_cache, plan.out_cache_loc, k_fp8, k_scale)
        q_fp8, q_scale = fp8.quantize_fp8_e4m3_per_vector(q, block=self.head_dim)
        weights = w * q_scale.squeeze(-1)
        if isinstance(plan, NSAExtendPlan):
            return indexer_topk_extend(plan, q_fp8, weights, index_cache)
        return indexer_topk(plan, q_fp8, weights, index_cache)
