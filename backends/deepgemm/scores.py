"""The indexer score both logits references compute, one way, so they agree bit for bit.

``score = k_scale * sum_h w_h * relu(q_h . k)``. The fp8 dot products are exact
in float64 (4-bit mantissas, 128 terms: no rounding, whatever the summation
order), and the weighted head sum is element-wise in a fixed head order, so
the paged (decode) and ragged (prefill) references give the same fp32 score
for the same query and key: a prompt fed in chunks selects the same top-k as
the same prompt fed token by token.
"""

from __future__ import annotations

import torch

from planner.errors import PlanError


def weighted_head_sum(dots: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """``sum_h w[r, h] * relu(dots[r, h, c])`` in float64, heads in order; ``dots [R, H, C]``.

    Element-wise ops only (no reduction kernel), so the rounding order is fixed by the
    spec rather than by a reduction's vectorisation: the same bits on every device.
    ``dots`` is overwritten.
    """
    dots.clamp_(min=0).mul_(w64.unsqueeze(-1))
    acc = dots[:, 0].clone()
    for h in range(1, dots.shape[1]):
        acc += dots[:, h]
    return acc


LOGITS_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}
"""The ``logits_dtype`` names sgl-deep-gemm 0.1.0 turns into a dtype it can write
(``str(logits_dtype).split('.')[-1]`` looked up in c10's dtype names; its host code then
allows float32 and bfloat16 only)."""


def parse_logits_dtype(logits_dtype: object) -> torch.dtype:
    """``logits_dtype`` as 0.1.0 reads it (a ``torch.dtype`` or its name), or a ``PlanError``.

    0.1.0 writes bf16 logits by rounding its fp32 result once, to nearest even
    (``static_cast<bfloat16_t>(float)`` in the kernels' store), which is what
    ``Tensor.to(torch.bfloat16)`` of the fp32 reference does.
    """
    name = str(logits_dtype).split(".")[-1]
    if not isinstance(logits_dtype, (torch.dtype, str)) or name not in LOGITS_DTYPES:
        raise PlanError(
            "deep_gemm 0.1.0 writes float32 or bfloat16 logits only",
            field="logits_dtype",
            expected="torch.float32 or torch.bfloat16",
            actual=logits_dtype,
        )
    return LOGITS_DTYPES[name]


def split_scaled_q(q: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``q`` of 0.1.0's ``fp8_fp4_*`` functions: a ``(q, q_sf)`` tuple or list.

    0.1.0's wrapper takes ``q[0], q[1]``; a bare tensor reaches a ``torch.Tensor(...)``
    call that raises ``TypeError``, so only the pair is accepted here too. ``q_sf`` None is
    fp8 e4m3 ``q``; a ``q_sf`` tensor means packed fp4 ``q`` with int32 UE8M0 scales.
    """
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise PlanError(
            "must be the pair (q, q_sf), as deep_gemm 0.1.0's fp8_fp4_* functions take it; "
            "pass (q, None) for fp8 q",
            field="q",
            expected="(q, q_sf)",
            actual=type(q).__name__,
        )
    q_fp, q_sf = q
    return q_fp, q_sf


def refuse_fp4(field: str) -> PlanError:
    """The refusal for fp4 inputs where no device kernel can take them."""
    return PlanError(
        f"fp4 inputs (q with scale factors q_sf) are not supported by the reference: "
        f"argument `{field}`; they run only on deep_gemm itself (SM100, CUDA tensors)",
        field=field,
        expected="(q, None) with float8_e4m3fn q",
        actual="(q, q_sf)",
    )
