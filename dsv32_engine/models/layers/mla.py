"""Multi-head latent attention for decode, with absorbed up-projections.

The cache holds one 576-wide row per token (512 latent + 64 rope key) shared
by all heads. Decode never expands it to per-head keys/values: the key
up-projection ``W_UK`` is folded into the query (``q_abs = q_nope . W_UK``)
and the value up-projection ``W_UV`` is applied after attention, so the
kernel attends over the latent directly. Only the top-k tokens chosen by the
indexer take part (sparse MLA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backends.nsa import NSAExtendPlan, NSAPlan
from backends.nsa.attention import sparse_mla
from backends.nsa_flashinfer import NSAFlashInferPlan, sparse_mla_flashinfer
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.exact import FusedWeights, Linear, contract, exact
from dsv32_engine.models.layers.indexer import Indexer
from dsv32_engine.models.layers.kv_write_triton import write_latent_kv_triton
from dsv32_engine.models.layers.norm import RMSNorm
from dsv32_engine.models.layers.rope import apply_rope_interleaved


class MLA(nn.Module):
    """DeepSeek-V3.2 attention block: projections, cache write, indexer, sparse decode."""

    batch_invariant: bool = False
    """The batch-invariant mode (``exact.set_batch_invariant``): the fused input projection
    and the per-head absorb/output einsums through ``invariant_gemm`` on CUDA (the
    ``Linear`` layers hold their own flag)."""

    def __init__(self, cfg: DSV32Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        h, eps = self.n_heads, cfg.rms_norm_eps
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False, dtype=dtype)
        self.wkv_a = Linear(cfg.hidden_size, cfg.kv_cache_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.kv_lora, eps)
        self.wkv_b = Linear(self.kv_lora, h * (self.nope + self.v_dim), bias=False, dtype=dtype)
        self.wo = Linear(h * self.v_dim, cfg.hidden_size, bias=False, dtype=dtype)
        self.indexer = Indexer(cfg, dtype)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums ``wo``'s partial output over tensor-parallel ranks (None: all heads here)."""
        self.in_proj: FusedWeights | None = None
        """``wq_a``, ``wkv_a`` and the indexer's ``wk`` as one GEMM (``fuse_projections``)."""

    def fuse_projections(self) -> None:
        """Run the three projections of the layer's input as one GEMM (on GPUs: at decode
        sizes the 576- and 128-wide ones read their weights far below bandwidth)."""
        self.in_proj = FusedWeights([self.wq_a, self.wkv_a, self.indexer.wk])

    # Steps 1-3 and 5 of the decode layer, separately callable for tests.

    def project_q(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qa: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qr [rows, q_lora], q_nope [rows, H, nope], q_rope [rows, H, rope])``, roped;
        ``qa``: ``wq_a(x)`` when already computed (the fused input projection)."""
        qr = self.q_norm(self.wq_a(x) if qa is None else qa)
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        return qr, q_nope, apply_rope_interleaved(q_rope, cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kva: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent [rows, kv_lora] normed, k_rope [rows, rope] roped)``: what is cached;
        ``kva``: ``wkv_a(x)`` when already computed."""
        kv = self.wkv_a(x) if kva is None else kva
        latent, k_rope = kv.split([self.kv_lora, self.rope], dim=-1)
        return self.kv_norm(latent), apply_rope_interleaved(k_rope, cos, sin)

    def write_kv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        loc: torch.Tensor,
        kva: torch.Tensor | None = None,
    ) -> None:
        """Store ``project_kv``'s two parts as the rows ``kv_cache[loc]``.

        On CUDA that is one Triton launch (``kv_write_triton``) instead of five (norm, rope,
        cat, cast, index_put), with the same bits. The CPU keeps the torch ops, whose
        float64 norm the CPU model's exactness tests depend on; so does anything autograd
        would record, which the kernel cannot."""
        kv = self.wkv_a(x) if kva is None else kva
        if self.kv_norm.takes_kernel(kv):  # CUDA, nothing autograd would record
            norm = self.kv_norm
            write_latent_kv_triton(kv, norm.weight, norm.eps, cos, sin, kv_cache, loc)
            return
        latent, k_rope = self.project_kv(x, cos, sin, kv)
        kv_cache[loc] = torch.cat([latent, k_rope], dim=-1).to(kv_cache.dtype)

    def _wkv_b(self) -> torch.Tensor:
        return self.wkv_b.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope . W_UK -> [rows, H, kv_lora]``: queries in latent space."""
        w_uk = self._wkv_b()[:, : self.nope]
        return contract(
            "rhd,hdc->rhc", q_nope, w_uk, dtype=q_nope.dtype, batch_invariant=self.batch_invariant
        )

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space -> ``W_UV`` per head -> ``wo`` -> ``[rows, dim]``.

        Head-sharded (``shard_heads``), ``wo`` holds this rank's heads' columns: its partial
        sum goes through ``reduce`` (the tensor-parallel all-reduce), in float64 on the CPU
        and rounded once after, so the sum of the ranks' partials rounds as the whole would.
        """
        dtype = self.wkv_b.weight.dtype
        w_uv = self._wkv_b()[:, self.nope :]
        o = contract(
            "rhc,hdc->rhd",
            o_latent.to(dtype),
            w_uv,
            dtype=dtype,
            batch_invariant=self.batch_invariant,
        )
        if self.reduce is None:
            return self.wo(o.flatten(1))
        o = o.flatten(1)
        partial = F.linear(o.double(), self.wo.weight.double()) if exact(o) else self.wo(o)
        return self.reduce(partial).to(dtype)

    def shard_heads(
        self, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Keep heads ``rank * H / world ..`` only (tensor parallel); ``reduce`` sums ``wo``'s
        partial outputs over the ranks. The latent cache and the indexer stay whole: every
        head reads the same 576-wide row, so each rank writes and reads the full KV."""
        per = self.n_heads // world
        heads = slice(rank * per, (rank + 1) * per)
        q = self.wq_b.weight.view(self.n_heads, -1, self.wq_b.in_features)[heads]
        kv = self.wkv_b.weight.view(self.n_heads, -1, self.kv_lora)[heads]
        wo = self.wo.weight.view(self.wo.out_features, self.n_heads, self.v_dim)[:, heads]
        self.wq_b = _linear(q.reshape(-1, q.shape[-1]))
        self.wkv_b = _linear(kv.reshape(-1, kv.shape[-1]))
        self.wo = _linear(wo.reshape(wo.shape[0], -1))
        self.n_heads, self.reduce = per, reduce

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor,
        sparse: NSAFlashInferPlan | None = None,
    ) -> torch.Tensor:
        """One attention over ``x [rows, dim]`` (already normed) -> ``[rows, dim]``.

        A row per query token: decode and verify rows, or every new token of an
        extend batch (its top-k from the ragged indexer, causal per token).
        ``sparse``: the batch's FlashInfer companion plan when the planner makes one
        (uniform batches with ``mla_kernel: flashinfer``); the sparse MLA then runs on
        FlashInfer's kernel, otherwise on the NSA plan's own.

        Writes this step's latent and rope key into ``kv_cache`` at the plan's
        ``out_cache_loc`` before attending, so every row sees its own token.
        """
        fused = None if self.in_proj is None else self.in_proj(x, self.batch_invariant)
        qa, kva, k_index = (None, None, None) if fused is None else fused
        qr, q_nope, q_rope = self.project_q(x, cos, sin, qa)
        self.write_kv(x, cos, sin, kv_cache, plan.out_cache_loc, kva)
        topk_slots = self.indexer(x, qr, cos, sin, plan, index_cache, k_index)
        q_abs = self.absorb_q(q_nope)
        if sparse is not None:
            o = sparse_mla_flashinfer(
                sparse, q_abs, q_rope, kv_cache, topk_slots, self.softmax_scale
            )
        else:
            o = sparse_mla(plan, q_abs, q_rope, kv_cache, topk_slots, self.softmax_scale)
        return self.output(o)


def _linear(weight: torch.Tensor) -> Linear:
    """A bias-free ``Linear`` holding a copy of ``weight`` (``[out, in]``), on its device."""
    layer = Linear(
        weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device
    )
    layer.weight.data.copy_(weight)
    return layer.requires_grad_(False)
