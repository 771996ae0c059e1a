"""The backend configurations benchmarks/verify_flashinfer.py runs, and their CPU smoke sizes.

One frozen ``Config`` per FlashInfer path worth verifying (paged decode at page 1 and 16,
on tensor cores, MLA at page 1 and 64, MLA target-verify), so the script and the GPU
tests (tests/gpu/test_flashinfer_gpu.py) cover the same set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from planner import ForwardMode


@dataclass(frozen=True)
class Config:
    """One backend configuration: the planner limits, the model dims, the capture sizes."""

    backend: str
    page_size: int
    heads: int
    kv_heads: int = 1
    head_dim: int = 128
    next_n: int = 1
    max_batch: int = 64
    max_context: int = 4096
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    use_tensor_cores: bool = False
    mla_backend: str = "auto"

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.TARGET_VERIFY if self.next_n > 1 else ForwardMode.DECODE

    def options(self) -> dict[str, Any]:
        if self.backend == "flashinfer_decode":
            return {
                "num_qo_heads": self.heads,
                "num_kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "use_tensor_cores": self.use_tensor_cores,
            }
        return {"num_heads": self.heads, "mla_backend": self.mla_backend}


CONFIGS = {
    "decode_p1_gqa": Config("flashinfer_decode", 1, heads=32, kv_heads=8, max_context=2048),
    "decode_p16_mha": Config("flashinfer_decode", 16, heads=16, kv_heads=16),
    "decode_p16_tc": Config("flashinfer_decode", 16, heads=32, kv_heads=4, use_tensor_cores=True),
    "mla_p1": Config("flashinfer_mla", 1, heads=16, max_context=2048),
    "mla_p64": Config("flashinfer_mla", 64, heads=16),
    "mla_p64_verify": Config("flashinfer_mla", 64, heads=16, next_n=2),
}


def cpu_smoke(config: Config) -> Config:
    """Small dims for ``--allow-cpu``: the script's logic, not FlashInfer's numbers."""
    small = {"heads": min(config.heads, 4), "kv_heads": min(config.kv_heads, 2), "head_dim": 64}
    if config.backend == "flashinfer_mla":
        small = {"heads": 2}
    return replace(config, max_batch=6, max_context=160, sizes=(1, 2, 4, 6), **small)
