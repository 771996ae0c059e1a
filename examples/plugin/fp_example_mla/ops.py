"""``mla_metadata``: one op, two outputs, like FlashMLA's ``get_mla_metadata``.

FlashMLA's decode kernel splits the KV blocks of a batch over a fixed number of SM parts
and merges the partial results of a request split across parts; ``get_mla_metadata``
computes, in one pass, what each part reads (``tile_scheduler_metadata``) and where each
request's splits start (``num_splits``). Both come from the same computation, so the op
declares two named outputs and the planner calls it once per batch for both fields.

The schedule here is FlashMLA's shape of it, simplified to an even cut: the batch's KV
blocks (``block_n`` tokens, the last one partial) are laid end to end and part ``p`` takes
blocks ``[p * per, (p + 1) * per)``, ``per = ceil(total / parts)``. It is not bit-equal to
FlashMLA's greedy schedule (a real plugin would add the kernel as a provider of an op
with FlashMLA's exact semantics); it is written to show what every provider must do:

- write every element of every output it is given (outputs start as garbage);
- under a CUDA graph, no host sync (no ``.item()``, ``.tolist()``, ``.cpu()``, no
  data-dependent shape): the torch reference below is tensor arithmetic only, so it runs
  inside the captured graph.
"""

from __future__ import annotations

import torch

from planner import metadata_op

META = 8
"""Ints per part in ``tile_scheduler_metadata`` (FlashMLA's ``TileSchedulerMetaDataSize``):
begin request, begin KV position, end request, end KV position (exclusive), the begin
request's split index, then three zeros."""

mla_metadata = metadata_op(
    "mla_metadata",
    "FlashMLA-style decode schedule over the SM parts (tile_scheduler_metadata[parts, 8]: "
    "begin req, begin pos, end req, end pos, first split) and each request's split offsets "
    "(num_splits[reqs + 1]), from the KV lengths: KV blocks cut evenly over the parts.",
    outputs=("tile_scheduler_metadata", "num_splits"),
)


@mla_metadata.provider("torch")
def mla_metadata_torch(
    tile: torch.Tensor, num_splits: torch.Tensor, seq_lens: torch.Tensor, *, block_n: int
) -> None:
    """The exact reference; graph-safe (tensor arithmetic only, no host sync)."""
    parts, reqs = tile.shape[0], seq_lens.shape[0]
    lens = seq_lens.long()
    cu = torch.zeros(reqs + 1, dtype=torch.long, device=lens.device)
    torch.cumsum(torch.div(lens + block_n - 1, block_n, rounding_mode="floor"), 0, out=cu[1:])
    total = cu[-1]
    per = torch.div(total + parts - 1, parts, rounding_mode="floor").clamp(min=1)
    p = torch.arange(parts, device=lens.device)
    start = torch.minimum(p * per, total)
    end = torch.minimum(start + per, total)
    empty = start >= end
    begin = torch.searchsorted(cu, start, right=True) - 1
    last = torch.searchsorted(cu, (end - 1).clamp(min=0), right=True) - 1
    first = begin.clamp(max=reqs - 1)
    end_pos = torch.minimum((end - cu[last]) * block_n, lens[last])
    tile.zero_()
    tile[:, 0] = torch.where(empty, reqs, begin)
    tile[:, 1] = torch.where(empty, 0, (start - cu[first]) * block_n)
    tile[:, 2] = torch.where(empty, reqs - 1, last)
    tile[:, 3] = torch.where(empty, 0, end_pos)
    tile[:, 4] = torch.where(empty, 0, p - torch.div(cu[first], per, rounding_mode="floor"))
    splits = torch.div(cu[1:] - 1, per, rounding_mode="floor") - torch.div(
        cu[:-1], per, rounding_mode="floor"
    )
    num_splits[0] = 0
    torch.cumsum(splits + 1, 0, out=num_splits[1:])
