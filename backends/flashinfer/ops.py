"""FlashInfer's metadata ops: the paged-KV tables (device) and ``flashinfer_plan`` (host).

Device ops, each with the exact torch reference and a Triton kernel:

- ``pages_per_request``: ``ceil(seq_len / page_size)``, whose prefix sum
  (the generic ``cumsum_with_zero``) is ``kv_indptr``;
- ``last_page_len``: tokens in each request's last page;
- ``paged_kv_indices``: the flat ragged page list over a ``[req_pages]`` buffer.

``flashinfer_plan`` is the host op (``graph_safe=False``): it runs in
``replay()`` outside the graph, takes the batch's host lengths
(``seq_lens_cpu``) and the plan tensors FlashInfer's wrapper is bound to,
writes a 4-entry summary ``[requests, pages, tokens, longest]`` so dumps and
debug-mode replay checks see what FlashInfer was planned with, and returns
the handle of the wrapper it planned, which the plan carries to the layers.
The planner calls it the same way in every phase, ``static`` saying whether its
tensors are the captured ones (capture and replay: a graph slot, whose handle is
the same at every replay) or an eager plan's (the shared eager slot).
Its ``flashinfer`` provider plans a real wrapper; its ``torch`` provider does
only the bookkeeping, so the three phases run and are checked on any machine.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from backends.common.ops import with_providers
from backends.flashinfer import kernels as tri
from backends.flashinfer import reference as ref
from backends.flashinfer import wrappers
from planner.errors import SchemaError
from planner.ops import metadata_op

__all__ = ["flashinfer_plan", "last_page_len", "paged_kv_indices", "pages_per_request"]

pages_per_request = metadata_op(
    "pages_per_request", "out[r] = ceil(seq_lens[r] / page_size): pages in request r's page list."
)
last_page_len = metadata_op(
    "last_page_len", "out[r] = (seq_lens[r] - 1) % page_size + 1: tokens in request r's last page."
)
paged_kv_indices = metadata_op(
    "paged_kv_indices",
    "FlashInfer's flat page list: out[kv_indptr[r] + p] = req_to_token[pool[r], p * page_size]"
    " // page_size for p < pages of r; 0 elsewhere.",
)
flashinfer_plan = metadata_op(
    "flashinfer_plan",
    "Host op: plan FlashInfer's wrapper for this batch from host lengths; out = [requests, pages,"
    " tokens, longest].",
)

with_providers(
    [
        (pages_per_request, ref.pages_per_request, tri.pages_per_request),
        (last_page_len, ref.last_page_len, tri.last_page_len),
        (paged_kv_indices, ref.paged_kv_indices, tri.paged_kv_indices),
    ]
)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {**_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def dtype_named(name: str, *, field: str, kv: bool = False) -> torch.dtype:
    """A dtype setting by name (settings stay JSON-able strings)."""
    table = _KV_DTYPES if kv else _DTYPES
    if name not in table:
        raise SchemaError("unsupported dtype", field=field, expected=sorted(table), actual=name)
    return table[name]


def wrapper_config(kind: str, params: dict[str, Any]) -> wrappers.WrapperConfig:
    """The op's resolved parameters as the (hashable) wrapper configuration, made once per
    distinct parameters (every replay asks)."""
    return _config(kind, tuple(params.items()))


@functools.cache
def _config(kind: str, items: tuple) -> wrappers.WrapperConfig:
    return _new_config(kind, dict(items))


def _new_config(kind: str, params: dict[str, Any]) -> wrappers.WrapperConfig:
    return wrappers.WrapperConfig(
        kind=kind,
        page_size=params["page_size"],
        next_n=params["next_n"],
        heads=params["heads"],
        kv_heads=params.get("kv_heads", 1),
        head_dim=params["head_dim"],
        rope_dim=params.get("rope_dim", 0),
        q_dtype=dtype_named(params["q_dtype"], field=f"{kind}.q_dtype"),
        kv_dtype=dtype_named(params["kv_dtype"], field=f"{kind}.kv_dtype", kv=True),
        sm_scale=params.get("sm_scale"),
        use_tensor_cores=bool(params.get("use_tensor_cores", False)),
        workspace_mb=params.get("workspace_mb", 128),
        backend=params.get("backend", "auto"),
    )


def _plan(
    use_flashinfer: bool, out: torch.Tensor, inputs: tuple, params: dict[str, Any]
) -> wrappers.WrapperHandle:
    """``inputs``: ``seq_lens_cpu, qo_indptr, kv_indptr, kv_indices, kv_tail``; ``params``
    the op's (a fresh dict per call, which this consumes: the providers hand theirs on
    instead of unpacking it into keywords again, a replay's cost)."""
    kind, static = params.pop("kind"), params.pop("static")
    seq_lens_cpu, *bound = inputs
    return wrappers.POOL.plan(
        wrapper_config(kind, params),
        static=static,
        use_flashinfer=use_flashinfer,
        seq_lens_cpu=seq_lens_cpu,
        bound=tuple(bound),
        out=out,
    )


@flashinfer_plan.provider("torch", graph_safe=False)
def _plan_bookkeeping(
    out: torch.Tensor, *inputs: torch.Tensor, **params: Any
) -> wrappers.WrapperHandle:
    """No FlashInfer: record the host plan arguments and the summary; the reference reads the plan."""
    return _plan(False, out, inputs, params)


def flashinfer_usable(device: torch.device) -> bool:
    """FlashInfer's kernels need CUDA and the package; checked without importing it."""
    return torch.device(device).type == "cuda" and wrappers.flashinfer_importable()


# Looked up at call time (not bound here), so tests can stand a fake FlashInfer in on the CPU.
@flashinfer_plan.provider("flashinfer", graph_safe=False, available=lambda d: flashinfer_usable(d))
def _plan_flashinfer(
    out: torch.Tensor, *inputs: torch.Tensor, **params: Any
) -> wrappers.WrapperHandle:
    """Plan the slot's FlashInfer wrapper (graph wrapper for static views, else the eager one)."""
    return _plan(True, out, inputs, params)
