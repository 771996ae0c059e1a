"""Host twins of FlashInfer's per-request ops, for eager plans (see ``backends.common.host_twins``).

``paged_kv_indices`` reads the token table on the device and has no twin.
"""

from __future__ import annotations

import numpy as np

from backends.flashinfer import ops

I32 = np.int32


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
