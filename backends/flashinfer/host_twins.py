"""Host twins of FlashInfer's per-request ops, for eager plans (see ``backends.common.host_twins``).

``paged_kv_indices`` reads the token table on the device and has no twin. The twins'
compiled forms are in ``host_twins.c``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.flashinfer import ops
from planner.native import int32_params

I32 = np.int32
_C = Path(__file__).resolve().with_suffix(".c")


@ops.pages_per_request.host_twin()
def pages_per_request(out: np.ndarray, seq_lens: np.ndarray, page_size: int) -> None:
    # The reference divides with rounding_mode="trunc": round toward zero, negatives included.
    top = seq_lens + I32(page_size - 1)
    np.floor_divide(top, I32(page_size), out=out)
    out += (top < 0) & (np.remainder(top, I32(page_size)) != 0)


@ops.last_page_len.host_twin()
def last_page_len(out: np.ndarray, seq_lens: np.ndarray, page_size: int) -> None:
    np.fmod(seq_lens - I32(1), I32(page_size), out=out)  # C remainder, as torch.fmod
    out += I32(1)


@ops.pages_per_request.native_twin(_C, "fp_twin_pages_per_request")
@ops.last_page_len.native_twin(_C, "fp_twin_last_page_len")
def _page_size(page_size: int) -> tuple[int, ...] | None:
    return int32_params(page_size, low=1)
