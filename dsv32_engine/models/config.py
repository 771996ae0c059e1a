"""DeepSeek-V3.2 model configuration, validated once so layers can trust it.

Field names follow DeepSeek-V3.2's Hugging Face ``config.json`` so a reader of
either sees the same words; the only additions are ``page_size`` (fixed by the
kernels' KV layout) and ``moe_stand_in_dim`` (a dense MLP instead of MoE, so a
61-layer model with real attention shapes fits one GPU).

Presets: ``tiny`` (CPU tests, milliseconds per step), ``small`` (GPU, real
attention/indexer kernel dimensions, few layers), ``shapes`` (all 61 layers at
real attention dimensions, dense FFN stand-in) and ``full`` (the real 671B
numbers, for validation and arithmetic only).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.deepgemm import BLOCK_KV
from planner.errors import ConfigError

# Kernel-fixed dimensions (deep_gemm paged MQA logits, FlashMLA-style sparse decode).
KERNEL_INDEX_HEADS = (32, 64)
KERNEL_INDEX_HEAD_DIM = 128
KERNEL_Q_HEADS = (64, 128)
KERNEL_KV_LORA = 512
KERNEL_ROPE = 64
PRESETS = ("tiny", "small", "shapes", "full")


class YarnScaling(BaseModel):
    """YaRN rope scaling, as in ``config.json``'s ``rope_scaling``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["yarn"] = "yarn"
    factor: float = Field(40.0, ge=1.0)
    original_max_position_embeddings: int = Field(4096, gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = Field(1.0, ge=0)
    mscale_all_dim: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _betas_ordered(self) -> YarnScaling:
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"rope_scaling.beta_fast ({self.beta_fast}) must exceed "
                f"rope_scaling.beta_slow ({self.beta_slow})"
            )
        return self


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature correction, 0.1 * m * ln(s) + 1 (1 when unscaled)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _positive(limit: int = 1) -> Any:
    return Field(ge=limit)


class DSV32Config(BaseModel):
    """Every number a DeepSeek-V3.2 decoder needs; frozen and validated.

    Cross-field rules live here, not in the layers, so a bad config fails at
    load time with the field name rather than as a shape error mid-forward.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = _positive()
    hidden_size: int = _positive()
    num_hidden_layers: int = _positive()
    first_k_dense_replace: int = Field(ge=0)
    intermediate_size: int = _positive()
    moe_intermediate_size: int = _positive()
    n_routed_experts: int = _positive()
    n_shared_experts: int = Field(ge=0)
    num_experts_per_tok: int = _positive()
    n_group: int = _positive()
    topk_group: int = _positive()
    routed_scaling_factor: float = Field(gt=0)
    q_lora_rank: int = _positive()
    kv_lora_rank: int = _positive()
    qk_nope_head_dim: int = _positive()
    qk_rope_head_dim: int = _positive(2)
    v_head_dim: int = _positive()
    num_attention_heads: int = _positive()
    index_n_heads: int = _positive()
    index_head_dim: int = _positive(2)
    index_topk: int = _positive()
    rope_theta: float = Field(gt=0)
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = _positive()
    rms_norm_eps: float = Field(gt=0, lt=1)
    page_size: int = Field(
        BLOCK_KV, description="KV tokens per page: fixed by deep_gemm's paged kernels"
    )
    moe_stand_in_dim: int | None = Field(default=None, ge=1)

    @field_validator("index_head_dim")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(
                f"index_head_dim must be a power of 2 (Sylvester Hadamard rotation), got {v}"
            )
        return v

    @field_validator("page_size")
    @classmethod
    def _kernel_page(cls, v: int) -> int:
        if v != BLOCK_KV:
            raise ValueError(f"page_size must be {BLOCK_KV} (deep_gemm's KV block), got {v}")
        return v

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rope rotates pairs), got {v}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> DSV32Config:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(
            self.first_k_dense_replace <= self.num_hidden_layers,
            f"first_k_dense_replace ({self.first_k_dense_replace}) must be <= "
            f"num_hidden_layers ({self.num_hidden_layers})",
        )
        need(
            self.index_head_dim > self.qk_rope_head_dim,
            f"index_head_dim ({self.index_head_dim}) must exceed qk_rope_head_dim "
            f"({self.qk_rope_head_dim}): the indexer head is rope part then nope part",
        )
        need(
            self.n_routed_experts % self.n_group == 0,
            f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
            f"n_group ({self.n_group})",
        )
        need(
            self.topk_group <= self.n_group,
            f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})",
        )
        per_group = self.n_routed_experts // self.n_group
        need(
            self.n_group == 1 or per_group >= 2,
            f"n_routed_experts / n_group ({per_group}) must be >= 2: groups are ranked "
            "by the sum of their top-2 scores",
        )
        need(
            self.num_experts_per_tok <= self.topk_group * per_group,
            f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= experts in the "
            f"kept groups (topk_group {self.topk_group} x {per_group})",
        )
        return self

    # ----------------------------------------------------------------- derived

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the non-absorbed attention (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one MLA cache slot: latent then k_rope (576 in the real model)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_cache_dim(self) -> int:
        """Bytes per token in the index cache: fp8 key plus one fp32 scale."""
        return self.index_head_dim + 4

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times YaRN mscale^2 when extended."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and self.max_position_embeddings > rs.original_max_position_embeddings:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are MoE (or the dense stand-in)."""
        return layer >= self.first_k_dense_replace

    def kernel_issues(self) -> list[str]:
        """Why the real GPU kernels (deep_gemm, FlashMLA sparse) cannot run this config.

        Empty means they can. The CPU torch references accept any valid config.
        """
        issues = []
        if self.index_n_heads not in KERNEL_INDEX_HEADS:
            issues.append(f"index_n_heads {self.index_n_heads} not in {KERNEL_INDEX_HEADS}")
        if self.index_head_dim != KERNEL_INDEX_HEAD_DIM:
            issues.append(f"index_head_dim {self.index_head_dim} != {KERNEL_INDEX_HEAD_DIM}")
        if self.num_attention_heads not in KERNEL_Q_HEADS:
            issues.append(f"num_attention_heads {self.num_attention_heads} not in {KERNEL_Q_HEADS}")
        if self.kv_lora_rank != KERNEL_KV_LORA:
            issues.append(f"kv_lora_rank {self.kv_lora_rank} != {KERNEL_KV_LORA}")
        if self.qk_rope_head_dim != KERNEL_ROPE:
            issues.append(f"qk_rope_head_dim {self.qk_rope_head_dim} != {KERNEL_ROPE}")
        return issues

    def param_count(self) -> int:
        """Parameters of ``DSV32Model`` for this config, by arithmetic (no allocation)."""
        d, h = self.hidden_size, self.num_attention_heads
        attn = (
            d * self.q_lora_rank
            + self.q_lora_rank  # q_norm
            + self.q_lora_rank * h * self.qk_head_dim
            + d * self.kv_cache_dim
            + self.kv_lora_rank  # kv_norm
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            + h * self.v_head_dim * d
        )
        indexer = (
            self.q_lora_rank * self.index_n_heads * self.index_head_dim
            + d * self.index_head_dim
            + 2 * self.index_head_dim  # LayerNorm weight + bias
            + d * self.index_n_heads
        )
        norms = 2 * d

        def mlp(inter: int) -> int:
            return 3 * d * inter

        if self.moe_stand_in_dim is not None:
            moe = mlp(self.moe_stand_in_dim)
        else:
            moe = (
                self.n_routed_experts * (d + 1)  # gate weight + bias
                + self.n_routed_experts * mlp(self.moe_intermediate_size)
                + (
                    mlp(self.n_shared_experts * self.moe_intermediate_size)
                    if self.n_shared_experts
                    else 0
                )
            )
        dense_layers = self.first_k_dense_replace
        moe_layers = self.num_hidden_layers - dense_layers
        per_layer = attn + indexer + norms
        return (
            self.num_hidden_layers * per_layer
            + dense_layers * mlp(self.intermediate_size)
            + moe_layers * moe
            + 2 * self.vocab_size * d  # embedding + head
            + d  # final norm
        )

    # ----------------------------------------------------------------- presets

    @classmethod
    def tiny(cls) -> DSV32Config:
        """CPU preset: a decode step of a few requests takes milliseconds.

        Attention widths are shrunk (the torch references take any size); the
        indexer head stays 128 wide, the fp8 quantisation block, which costs
        nothing at 4 heads. ``index_topk`` 16 is below typical test lengths so top-k really
        selects, and 8 experts in 4 groups keep group limiting meaningful.
        """
        return cls(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            num_attention_heads=8,
            index_n_heads=4,
            index_head_dim=128,
            index_topk=16,
            rope_theta=10000.0,
            rope_scaling=YarnScaling(),
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
        )

    @classmethod
    def small(cls) -> DSV32Config:
        """GPU preset: real attention and indexer dimensions, 4 layers, small MoE.

        Runs the real kernels (see ``kernel_issues``) at a fraction of the cost.
        """
        # The real model's attention, indexer, rope and norm settings; only size shrinks.
        return cls(
            **{
                **cls.full().model_dump(),
                "vocab_size": 8192,
                "hidden_size": 1024,
                "num_hidden_layers": 4,
                "first_k_dense_replace": 1,
                "intermediate_size": 2048,
                "moe_intermediate_size": 256,
                "n_routed_experts": 16,
                "num_experts_per_tok": 4,
                "n_group": 4,
                "topk_group": 2,
                "q_lora_rank": 512,
            }
        )

    @classmethod
    def shapes(cls) -> DSV32Config:
        """All 61 layers at real dimensions, MoE replaced by a 2048-wide dense MLP.

        Every attention/indexer/cache shape and the layer count are the real
        model's, so planner and kernel timings per layer are representative,
        while the weights (~18B parameters, ~36 GB in bf16) fit one H200.
        """
        return cls(**{**cls.full().model_dump(), "moe_stand_in_dim": 2048})

    @classmethod
    def full(cls) -> DSV32Config:
        """The real DeepSeek-V3.2 (671B) numbers: validate and do arithmetic only."""
        return cls(
            vocab_size=129280,
            hidden_size=7168,
            num_hidden_layers=61,
            first_k_dense_replace=3,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            num_attention_heads=128,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=2048,
            rope_theta=10000.0,
            rope_scaling=YarnScaling(),
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
        )

    @classmethod
    def preset(cls, name: str) -> DSV32Config:
        """A preset by name (for YAML/CLI): ``tiny``, ``small``, ``shapes`` or ``full``."""
        if name not in PRESETS:
            raise ConfigError("unknown model preset", field="preset", expected=PRESETS, actual=name)
        return getattr(cls, name)()
