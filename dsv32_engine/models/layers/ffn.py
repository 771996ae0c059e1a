"""Feed-forward blocks: dense SwiGLU MLP and DeepSeek-V3-style MoE.

``MoE`` routes: only the chosen experts run, on tokens grouped by expert with grouped
GEMMs (``moe_routing``), with static shapes and no host sync, so a forward can be
captured in a CUDA graph. ``DenseMoE`` is the reference it is tested against: a dense
``[rows, experts]`` weight matrix (mostly zeros) and every expert on every row,
``n_routed_experts / num_experts_per_tok`` times the FLOPs and weight bytes. Both have
the same parameters (names and shapes), so either loads the other's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.exact import (
    FusedWeights,
    Linear,
    contract,
    forward_takes_kernel,
    silu,
)
from dsv32_engine.models.layers.moe_gate_triton import MAX_EXPERTS, route_reference, route_triton
from dsv32_engine.models.layers.moe_routing import routed_experts
from dsv32_engine.models.layers.swiglu_triton import silu_mul


class MLP(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the dense layers, the shared expert, the stand-in."""

    batch_invariant: bool = False
    """The batch-invariant mode (``exact.set_batch_invariant``): the fused ``w1|w3`` GEMM
    through ``invariant_gemm`` on CUDA (``w1``, ``w2``, ``w3`` hold their own flags)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter, bias=False, dtype=dtype)
        self.w2 = Linear(inter, dim, bias=False, dtype=dtype)
        self.w3 = Linear(dim, inter, bias=False, dtype=dtype)
        self.gate_up: FusedWeights | None = None
        """``w1`` and ``w3`` as one GEMM (``fuse_projections``)."""

    def fuse_projections(self) -> None:
        """Run ``w1`` and ``w3`` (same input) as one GEMM: one weight read, one launch."""
        self.gate_up = FusedWeights([self.w1, self.w3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = None if self.gate_up is None else self.gate_up(x, self.batch_invariant)
        gate, up = (self.w1(x), self.w3(x)) if fused is None else fused
        # One launch on CUDA (reading the fused GEMM's halves in place), same bits as the
        # two torch kernels; the CPU's float64 silu otherwise (``swiglu_triton.silu_mul``).
        return self.w2(silu_mul(gate, up))


class Gate(nn.Module):
    """Sigmoid router with a selection-only bias and group-limited top-k.

    The bias (``e_score_correction_bias``) balances load: it shifts which
    experts are *chosen* but not how much they *weigh*, so weights come from
    the unbiased scores, normalised over the chosen experts and scaled.

    On CUDA everything after the GEMM is one launch (``moe_gate_triton``) instead of
    about fifteen small kernels; the CPU keeps the torch formula (``route_reference``),
    whose float64 bits the CPU model's exactness tests depend on.

    In the batch-invariant mode the logits' GEMM runs on ``invariant_gemm``'s kernel on CUDA
    (the routing after it is per row already).
    """

    batch_invariant: bool = False
    """The batch-invariant mode (``exact.set_batch_invariant``)."""

    def __init__(self, cfg: DSV32Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """Whether routing runs the Triton kernel: CUDA and nothing autograd would need a
        backward for (as ``RMSNorm.takes_kernel``), at most ``MAX_EXPERTS`` experts and
        logits the kernel reads (fp32, fp16, bf16)."""
        wide = torch.promote_types(x.dtype, self.weight.dtype)
        return (
            self.weight.shape[0] <= MAX_EXPERTS
            and wide in (torch.float32, torch.float16, torch.bfloat16)
            and forward_takes_kernel(x, self.weight, self.bias)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [rows, top_k] fp32, indices [rows, top_k] int64)``."""
        route = (self.bias, self.top_k, self.n_group, self.topk_group, self.route_scale)
        mode = {"batch_invariant": self.batch_invariant}
        if self.takes_kernel(x):
            # The GEMM in its own dtype, the same call as below: the kernel widens the logits
            # to fp32 in registers (exactly), which saves the cast's launch.
            wide = torch.promote_types(x.dtype, self.weight.dtype)
            return route_triton(contract("rd,ed->re", x, self.weight, dtype=wide, **mode), *route)
        logits = contract("rd,ed->re", x, self.weight, dtype=torch.float32, **mode)
        return route_reference(logits, *route)


class MoE(nn.Module):
    """Routed experts (stacked weights) plus shared experts, graph-capturable.

    ``grouped_mm_provider`` forces a grouped GEMM provider (``grouped_gemm.PROVIDERS``);
    by default it is chosen from dtype and device per call.

    In the batch-invariant mode on CUDA the routed experts run the Triton grouped GEMM with
    a fixed row tile and the combine adds the top-k slots one by one in slot order
    (``moe_routing.routed_experts``); gate and shared expert hold their own flags.
    """

    batch_invariant: bool = False
    """The batch-invariant mode (``exact.set_batch_invariant``)."""

    def __init__(
        self,
        cfg: DSV32Config,
        dtype: torch.dtype | None = None,
        grouped_mm_provider: str | None = None,
    ) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, dtype)
        # Stacked [experts, out, in] like nn.Linear weights.
        self.w1 = nn.Parameter(torch.empty(e, i, d, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(e, i, d, dtype=dtype))
        self.shared = MLP(d, cfg.n_shared_experts * i, dtype) if cfg.n_shared_experts > 0 else None
        self.grouped_mm_provider = grouped_mm_provider

    def _with_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            y = y + self.shared(x).float()
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)
        y = routed_experts(
            x,
            weights,
            indices,
            self.w1,
            self.w2,
            self.w3,
            self.grouped_mm_provider,
            batch_invariant=self.batch_invariant,
        )
        return self._with_shared(x, y)


class DenseMoE(MoE):
    """The dense-routing reference: every expert on every row, weighted by a dense matrix.

    Same parameters as ``MoE``; kept because it is obviously right (one ``bmm`` per
    projection, no dispatch), not because it is fast.
    """

    def routing_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """Dense ``[rows, experts]`` fp32 routing weights, zero for unchosen experts."""
        weights, indices = self.gate(x)
        dense = torch.zeros(x.shape[0], self.w1.shape[0], dtype=torch.float32, device=x.device)
        return dense.scatter(1, indices, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.routing_matrix(x)  # [rows, E]
        xe = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)  # [E, rows, dim]
        gate = contract("erd,eid->eri", xe, self.w1, dtype=x.dtype)
        h = silu(gate) * contract("erd,eid->eri", xe, self.w3, dtype=x.dtype)
        ye = contract("eri,edi->erd", h, self.w2, dtype=x.dtype)  # [E, rows, dim]
        return self._with_shared(x, contract("re,erd->rd", route, ye, dtype=torch.float32))
