"""Contractions that give the same bits for a row whatever else is in the batch (on the CPU).

A CPU matmul rounds a row differently when the batch has 1 row or 50: the
blocking changes with the shape. That last-bit drift would be harmless, but
the indexer quantises its queries to fp8 and keeps a top-k: one flipped fp8
rounding selects another KV token, and a prompt fed in chunks then decodes
differently from the same prompt fed token by token. The invariants the tests
hold (chunked prefill equals token-by-token decode; speculative greedy equals
plain greedy) are exact, so on the CPU every contraction of the reference
model accumulates in float64 and rounds once: the result is the correctly
rounded value up to float64 noise, the same bits for any batch shape.

On a GPU the model runs its production dtype with the usual kernels; there
these are plain ``nn.Linear`` / ``torch.einsum``, whose cuBLAS algorithm depends on the
batch's row count. In the batch-invariant mode (off by default, a plain ``batch_invariant``
attribute of each module that has a GEMM, set by ``set_batch_invariant``), the GEMMs here
run on CUDA through ``invariant_gemm``'s fixed-tile Triton matmul instead: a row's bits
then do not depend on the batch there either. Off CUDA the mode changes nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.triton_kernels import triton_available
from dsv32_engine.models.layers.invariant_gemm import invariant_contract, invariant_linear


def exact(t: torch.Tensor) -> bool:
    """Whether computations on ``t`` take the batch-invariant float64 path (the CPU)."""
    return t.device.type == "cpu"


def forward_takes_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a model op over ``tensors`` runs its Triton kernel rather than the torch
    formula: the first tensor on CUDA, Triton there, and nothing autograd would record.
    The kernels have no backward (the serving model needs none), and off CUDA the torch
    formulas stay, whose float64 bits the CPU model's exactness tests pin. One rule for
    every fused forward kernel, so none of them decides it differently."""
    first = tensors[0]
    if not first.is_cuda or not triton_available(first.device):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


_kernel_route = forward_takes_kernel
"""What ``invariant`` asks besides the mode (a module global, so tests can route CPU
tensors through the kernel's call sites)."""


def invariant(on: bool, *tensors: torch.Tensor) -> bool:
    """Whether a GEMM in the batch-invariant mode ``on`` runs ``invariant_gemm``'s kernel:
    the mode on, and the operands where the forward's Triton kernels run (CUDA, nothing
    autograd would record; see ``forward_takes_kernel``). The default path never asks
    anything else, so its kernels and bits are what they were."""
    return on and _kernel_route(*tensors)


def set_batch_invariant(root: nn.Module, on: bool) -> list[str]:
    """Set the batch-invariant mode on every module under ``root`` (itself included) whose
    class declares a ``batch_invariant`` attribute: a plain instance attribute, so two models
    in one process may differ. Returns the names of the modules set (``""``: ``root``)."""
    names = []
    for name, module in root.named_modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = on
            names.append(name)
    return names


def accumulate_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 on the CPU (batch invariance), float32 elsewhere: the dtype to accumulate in."""
    return torch.float64 if exact(t) else torch.float32


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU result does not depend on the batch's row count, nor its
    CUDA result in the batch-invariant mode."""

    batch_invariant: bool = False
    """The batch-invariant mode (see the module docstring); off by default."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.batch_invariant)

    def project(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """The layer in the given mode: for a caller that shares the layer but keeps its own
        mode (the MTP draft's use of the target's head)."""
        if invariant(batch_invariant, x, self.weight):
            return invariant_linear(x, self.weight, self.bias)
        if not exact(x):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), bias).to(x.dtype)


def contract(
    equation: str, *operands: torch.Tensor, dtype: torch.dtype, batch_invariant: bool = False
) -> torch.Tensor:
    """``torch.einsum`` in float64 on the CPU, in the operands' own dtype elsewhere; in ``dtype``.

    ``batch_invariant`` (the caller's mode): on CUDA the activation-by-weight einsums
    ``invariant_gemm.invariant_contract`` knows run there (fp32 accumulation, rounded once
    to ``dtype``); any other equation is refused rather than run batch-dependent."""
    if invariant(batch_invariant, *operands):
        return invariant_contract(equation, *operands, dtype=dtype)
    if exact(operands[0]):
        operands = tuple(op.double() for op in operands)
    else:  # one dtype for all, the widest given (an fp32 routing matrix over bf16 outputs)
        wide = functools.reduce(torch.promote_types, (op.dtype for op in operands))
        operands = tuple(op.to(wide) for op in operands)
    return torch.einsum(equation, *operands).to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` rounded once from float64 on the CPU: vectorised and scalar float32 paths
    disagree in the last bit, and which one a row gets depends on the batch's shape."""
    return F.silu(x.double()).to(x.dtype) if exact(x) else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` rounded once from float64 on the CPU (see :func:`silu`)."""
    return torch.sigmoid(x.double()).to(x.dtype) if exact(x) else torch.sigmoid(x)


class FusedWeights:
    """Several bias-free ``Linear`` layers over the same input, run as one GEMM.

    At decode batch sizes a projection's cost is reading its weight, and small ones
    (the 576- and 128-wide MLA and indexer key projections) read it far below the
    card's bandwidth. Stacked as row blocks of one buffer they are one larger GEMM.
    The layers keep views of that buffer as their weights, so ``state_dict``, ``load``
    (in-place copies) and ``save`` see the same parameters as before. If anything
    re-points a weight (``.to()``, a replaced parameter), ``__call__`` returns None and
    the caller runs the layers one by one: never a stale fused weight.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        if any(layer.bias is not None for layer in linears):
            raise ValueError("only bias-free Linear layers are fused")
        self.weight = torch.cat([layer.weight.detach() for layer in linears], dim=0)
        self.sizes = [layer.out_features for layer in linears]
        start = 0
        for layer, size in zip(linears, self.sizes, strict=True):
            layer.weight = nn.Parameter(self.weight[start : start + size], requires_grad=False)
            start += size
        self._linears = linears
        self._pointers = self._current()

    def _current(self) -> tuple[int, ...]:
        return tuple(layer.weight.data_ptr() for layer in self._linears)

    def __call__(
        self, x: torch.Tensor, batch_invariant: bool = False
    ) -> tuple[torch.Tensor, ...] | None:
        """Each layer's output (column views of one GEMM's), or None if the views broke;
        ``batch_invariant``: the owner's mode (the fused GEMM through ``invariant_gemm``)."""
        if self._current() != self._pointers or x.device != self.weight.device:
            return None
        if invariant(batch_invariant, x, self.weight):
            return invariant_linear(x, self.weight).split(self.sizes, dim=-1)
        return F.linear(x, self.weight).split(self.sizes, dim=-1)
