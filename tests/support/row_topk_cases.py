"""Row top-k test inputs shared by the reference and Triton test files: scores of several
flavours in strided views, slot tables like the plan's, the reference with its slot
mapping, and a dispatch trace that shows static shapes and no host sync."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.nsa.topk_ref import map_positions_to_slots, reference_row_topk

I32 = torch.int32
NAN, INF = float("nan"), float("inf")


def ref(rows: list[list[float]], lengths: list[int], k: int) -> list[list[int]]:
    x = torch.tensor(rows, dtype=torch.float32)
    return reference_row_topk(x, torch.tensor(lengths, dtype=I32), k).tolist()


def random_case(
    gen: torch.Generator, rows: int, width: int, kind: str, device: str = "cpu"
) -> torch.Tensor:
    """Scores of one flavour, in a strided view (row stride > width, like deep_gemm's)."""
    shape = (rows, width + 5)
    if kind == "distinct":
        x = torch.randperm(rows * shape[1], generator=gen).float().view(shape) - 100.0
    elif kind == "ties":
        x = torch.randint(-2, 3, shape, generator=gen).float()
    elif kind == "nasty":  # NaN, -inf, signed zeros, a few finite values
        choice = torch.randint(0, 6, shape, generator=gen)
        vals = torch.tensor([NAN, -INF, -0.0, 0.0, 1.5, -2.0])
        x = vals[choice]
    else:
        x = torch.randn(shape, generator=gen)
    return x.to(device)[:, :width]


def random_slots(gen: torch.Generator, reqs: int, width: int, device: str = "cpu") -> torch.Tensor:
    """A slot table like the plan's: int32, random values, row stride past its width."""
    table = torch.randint(-(2**31), 2**31 - 1, (reqs, width + 7), generator=gen, dtype=I32)
    return table.to(device)[:, :width]


def mapped_reference(
    x: torch.Tensor, lengths: torch.Tensor, k: int, slots: torch.Tensor, next_n: int
) -> torch.Tensor:
    return map_positions_to_slots(reference_row_topk(x, lengths, k), slots, next_n)


class Trace(TorchDispatchMode):
    """Records each op and its output shape: equal traces for different data mean static
    shapes and no data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        self.ops.append((func.__name__, shape))
        return out


SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")
