"""What one FlashInfer wrapper is planned for, besides the lengths: the pool's key."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WrapperConfig:
    """What one wrapper is planned for, besides the lengths (hashable: it keys the pool)."""

    kind: str  # "decode" (BatchDecodeWithPagedKVCacheWrapper) or "mla"
    page_size: int
    next_n: int
    heads: int
    kv_heads: int
    head_dim: int  # decode: head_dim; MLA: head_dim_ckv
    rope_dim: int  # MLA: head_dim_kpe; decode: 0
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float | None
    use_tensor_cores: bool = False
    workspace_mb: int = 128
    backend: str = "auto"

    @property
    def causal(self) -> bool:
        """Verify rows attend causally to the draft tokens before them; decode rows see all."""
        return self.next_n > 1
