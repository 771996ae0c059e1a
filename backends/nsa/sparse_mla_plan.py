"""The split schedule of the Triton sparse MLA decode kernel: a per-batch plan field.

Owns the kernel's tile configuration, the static split count of a capture size, the
per-batch split table (an exact torch reference and a bit-equal Triton kernel) and the
workspace sizing. Nothing here depends on the layer: the planner computes the table once
per forward batch and all 61 layers read it.

Design (flash-decoding over the top-k list):

* **Static per capture size**: ``splits = sparse_mla_num_splits(rows, ...)``, the most
  splits any row of that batch size may use. The attention kernel's launch grid is
  ``rows x splits x head_blocks`` programs and the combine kernel's grid and the
  workspace follow from it, so under CUDA graphs all of them are fixed at capture.
  ``splits`` comes from a wave model of the chip at full top-k length (lengths are not
  known at capture): small batches get many splits so ``rows x splits x head_blocks``
  covers the SMs; large ones get one (then the kernel writes the output directly and
  no combine runs). A fixed count (``nsa.mla_fixed_splits``, ``1..MAX_SPLITS``) replaces
  the model where a row must not depend on its batch: the grid per row, the combine's tile
  and the direct-write choice then follow from the count alone.
* **Per batch**: the table ``int32 [rows, splits + 1]`` of split boundaries in top-k
  positions. Row ``r``'s split ``s`` reads positions ``[t[r, s], t[r, s + 1])`` of its
  ``topk_slots`` row: the row's length ``min(kv_len, topk)`` cut into ``splits`` chunks
  of whole ``block_n`` tiles (``ceil(tiles / splits)`` each), the last ones possibly
  empty. ``t[r, 0] == 0``, ``t[r, splits] == len_r`` and the boundaries never decrease,
  so an empty split (``begin == end``) does no work: its program exits at once and the
  combine skips it. Pad rows (``r >= len(topk_lens)``, e.g. a graph's padding) are all
  zeros: no work, zero output.

The table depends only on ``topk_lens``, ``topk``, ``block_n`` and its own static shape,
never on a layer's data, which is what lets one plan serve every layer and be replayed
inside a captured graph (the table lives in a static buffer the planner refreshes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.common.triton_kernels import LazyKernel, triton_available
from planner.errors import PlanError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIG",
    "MAX_SPLITS",
    "SparseMLAConfig",
    "check_split_plan",
    "head_blocks",
    "new_split_plan",
    "new_workspace",
    "sparse_mla_num_splits",
    "sparse_mla_split_plan",
    "split_plan_torch",
    "split_plan_triton",
    "workspace_numel",
]

I32 = torch.int32


@dataclass(frozen=True)
class SparseMLAConfig:
    """One compiled variant of the attention kernel: a tile shape and its launch settings.

    Heads are the M dimension of the tiles, so every gathered KV row is reused by
    ``block_h`` heads; 64 is the most whose fp32 ``[64, 512]`` accumulator fits the
    registers of 8 warps (two warpgroups each own half the latent columns). ``block_n``
    KV rows are gathered per step: with the query tile (72 KB) and ``num_stages`` copies
    of the KV tile in shared memory, (32, 3) takes 148 KB and (64, 2) 221 KB of Hopper's
    227 KB (sm_90 compiles by Triton 3.9). 64 halves the per-key cost of the HGMMA
    descriptor setup and gives the QK product N = 32 per warpgroup instead of 16, at the
    price of more spills and a tight shared-memory fit. ``lazy_rescale`` rescales the
    accumulator only when a row's max grows by more than 2^8 (FA4's trick).
    """

    block_n: int = 32
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 3
    lazy_rescale: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise PlanError(
                    "tile sizes must be powers of two >= 16 (tensor-core minimum)",
                    field=f"sparse_mla.{name}",
                    expected="16, 32, 64, ...",
                    actual=value,
                )


DEFAULT_CONFIG = SparseMLAConfig(block_n=64, num_stages=2)
"""The variant served by default: the fastest of ``CONFIGS`` at every batch size on the H200
(Triton 3.6; 20 / 63 / 180 / 345 us at 1 / 16 / 64 / 128 rows of 2048 slots, 128 heads,
against 22-23 / 77 / 241 / 469 us for the 32-key tile; docs/benchmarks.md)."""

CONFIGS: tuple[SparseMLAConfig, ...] = (
    DEFAULT_CONFIG,
    SparseMLAConfig(),
    SparseMLAConfig(lazy_rescale=True),
    SparseMLAConfig(block_n=64, num_stages=2, lazy_rescale=True),
    SparseMLAConfig(num_stages=2),
    SparseMLAConfig(block_h=32, num_warps=4),
)
"""The tiny fixed set the GPU benchmark compares: no autotuning at capture or serving."""

# Wave model of sparse_mla_num_splits, in units of one (block_h x block_n) tile step.
# A program also loads its query tile and writes a partial; splitting at all adds the
# combine kernel and the partials' round trip. Rough H200 estimates, to recalibrate
# from benchmarks/kernels/sparse_mla.py.
PROGRAM_OVERHEAD_TILES = 2
SPLIT_OVERHEAD_TILES = 4

MAX_SPLITS = 64
"""The most splits a row may be given by a fixed split count (``nsa.mla_fixed_splits``).
The combine holds all of a row's splits in one ``[next_pow2(splits), block_l]`` fp32 tile
of at most 4096 values with ``block_l >= 16`` (``sparse_mla_triton``): 256 would still
fit, but past 64 the latent chunk drops below 64 columns and the combine's loads get
short, while 2048 top-k tokens in 64-token tiles never need more than 32 splits (the wave
model's own maximum). A count above a row's tiles leaves its last splits empty (no work,
skipped by the combine), so any count in range is correct, only slower."""


def head_blocks(heads: int, block_h: int) -> int:
    """Programs per (row, split): one per ``block_h`` heads."""
    return -(-heads // block_h)


def sparse_mla_num_splits(
    rows: int,
    *,
    heads: int,
    topk: int,
    num_sms: int,
    config: SparseMLAConfig = DEFAULT_CONFIG,
) -> int:
    """The static split count for batches of ``rows`` query rows (a capture size).

    Minimises a wave model at full length: ``programs = rows x splits x head_blocks``
    run ``ceil(programs / num_sms)`` waves of ``ceil(tiles / splits)`` tile steps plus a
    per-program overhead, plus a fixed cost once there is a combine. One program per SM
    is assumed (the tiles take most of the shared memory), so a batch that spills a few
    programs into a second wave pays a whole wave: the model splits it more instead.
    Ties go to fewer splits (smaller workspace, less combine traffic). Pure function of
    python ints, so the planner calls it per capture size without touching the device.
    """
    if rows <= 0:
        return 1
    tiles = max(1, -(-topk // config.block_n))
    per_split = rows * head_blocks(heads, config.block_h)
    best, best_cost = 1, None
    for splits in range(1, tiles + 1):
        waves = -(-(per_split * splits) // max(1, num_sms))
        cost = waves * (-(-tiles // splits) + PROGRAM_OVERHEAD_TILES)
        cost += SPLIT_OVERHEAD_TILES if splits > 1 else 0
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def new_split_plan(rows: int, splits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed table of the static shape ``[rows, splits + 1]`` (zeros = no work)."""
    return torch.zeros(rows, splits + 1, dtype=I32, device=device)


def workspace_numel(rows: int, splits: int, heads: int, latent: int) -> int:
    """fp32 elements of the split workspace: partial outputs ``[rows, splits, H, latent]``
    then log-sum-exps ``[rows, splits, H]``. Zero when ``splits == 1`` (direct write)."""
    if splits <= 1:
        return 0
    return rows * splits * heads * (latent + 1)


def new_workspace(
    rows: int, splits: int, heads: int, latent: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An fp32 workspace for one batch shape; reused by every layer (layers run in order)."""
    return torch.empty(
        workspace_numel(rows, splits, heads, latent), dtype=torch.float32, device=device
    )


def check_split_plan(out: torch.Tensor, topk_lens: torch.Tensor, topk: int, block_n: int) -> None:
    """Shapes, dtypes and devices of a split-plan call; no device sync (capture-safe)."""
    if topk_lens.dtype != I32 or topk_lens.dim() != 1:
        raise PlanError(
            "topk_lens must be int32 [rows]",
            field="topk_lens",
            expected="int32 [rows]",
            actual=f"{topk_lens.dtype} {tuple(topk_lens.shape)}",
        )
    if out.dtype != I32 or out.dim() != 2 or out.shape[1] < 2 or not out.is_contiguous():
        raise PlanError(
            "the split plan must be a contiguous int32 [rows, splits + 1] with splits >= 1",
            field="split_plan",
            expected="int32 [rows, splits + 1]",
            actual=f"{out.dtype} {tuple(out.shape)}",
        )
    if out.shape[0] < topk_lens.shape[0]:
        raise PlanError(
            "the split plan has fewer rows than topk_lens",
            field="split_plan",
            expected=f">= {topk_lens.shape[0]} rows",
            actual=out.shape[0],
        )
    if out.device != topk_lens.device:
        raise PlanError(
            "split plan and topk_lens must be on one device",
            field="split_plan",
            expected=str(topk_lens.device),
            actual=str(out.device),
        )
    if topk < 0:
        raise PlanError("topk must be >= 0", field="topk", expected=">= 0", actual=topk)
    if block_n <= 0:
        raise PlanError("block_n must be > 0", field="block_n", expected="> 0", actual=block_n)


def split_plan_torch(
    out: torch.Tensor, topk_lens: torch.Tensor, *, topk: int, block_n: int
) -> None:
    """The exact reference: write the split boundaries of every row into ``out``.

    ``len = clamp(topk_lens, 0, topk)``, ``chunk = max(1, ceil(ceil(len / block_n) /
    splits)) * block_n``, ``out[r, s] = min(s * chunk, len)``; rows past ``topk_lens``
    are zeros. Static shapes, no sync: capturable like the Triton version.
    """
    check_split_plan(out, topk_lens, topk, block_n)
    n, splits = topk_lens.shape[0], out.shape[1] - 1
    lens = topk_lens.to(torch.int64).clamp(0, topk)
    tiles = (lens + block_n - 1) // block_n
    chunk = ((tiles + splits - 1) // splits).clamp(min=1) * block_n
    s = torch.arange(splits + 1, device=out.device, dtype=torch.int64)
    out[:n] = torch.minimum(s.unsqueeze(0) * chunk.unsqueeze(1), lens.unsqueeze(1)).to(I32)
    out[n:] = 0


# --- Triton version ---------------------------------------------------------------

_BLOCK_R = 128


def _split_plan_kernel(out_ptr, lens_ptr, n, rows, splits, topk, block_n, BLOCK_R: tl.constexpr):
    # One program per BLOCK_R rows; columns written one at a time so the column count
    # stays a runtime value (no recompile per capture size). All values fit int32:
    # s * chunk <= (splits + 1) * (topk + block_n).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_out = r < rows
    lens = tl.load(lens_ptr + r, mask=r < n, other=0)
    lens = tl.minimum(tl.maximum(lens, 0), topk)
    tiles = (lens + block_n - 1) // block_n
    chunk = tl.maximum((tiles + splits - 1) // splits, 1) * block_n
    base = out_ptr + r.to(tl.int64) * (splits + 1)
    for s in range(0, splits + 1):
        tl.store(base + s, tl.minimum(s * chunk, lens), mask=in_out)


_split_plan = LazyKernel(_split_plan_kernel)


def split_plan_triton(
    out: torch.Tensor, topk_lens: torch.Tensor, *, topk: int, block_n: int
) -> None:
    """One launch, bit-equal to :func:`split_plan_torch` (integer arithmetic only)."""
    check_split_plan(out, topk_lens, topk, block_n)
    if not triton_available(out.device):
        raise RuntimeError(f"Triton kernels cannot run on {out.device}")
    rows, width = out.shape
    if rows == 0:
        return
    _split_plan[(triton.cdiv(rows, _BLOCK_R),)](
        out, topk_lens, topk_lens.shape[0], rows, width - 1, topk, block_n, BLOCK_R=_BLOCK_R
    )


def sparse_mla_split_plan(
    out: torch.Tensor, topk_lens: torch.Tensor, *, topk: int, block_n: int = DEFAULT_CONFIG.block_n
) -> torch.Tensor:
    """Fill the per-batch split table: Triton where it runs, else the torch reference."""
    if triton_available(out.device):
        split_plan_triton(out, topk_lens, topk=topk, block_n=block_n)
    else:
        split_plan_torch(out, topk_lens, topk=topk, block_n=block_n)
    return out
