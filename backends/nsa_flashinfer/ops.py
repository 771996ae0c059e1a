"""``nsa_flashinfer_plan``: the host op that plans FlashInfer's MLA kernel over the top-k.

It runs in ``replay()`` outside the graph (``graph_safe=False``), reads the batch's host
``seq_lens_cpu``, writes the 4-entry summary ``[rows, real rows, top-k tokens, longest]``
(so dumps and debug-mode replay checks see what FlashInfer was planned with) and returns
the handle of the slot it planned: called the same way in every phase, ``static`` saying
whether its tensors are the captured ones (a graph slot, whose handle is the same at every
replay) or an eager plan's. Its ``flashinfer`` provider plans a real wrapper; its
``torch`` provider keeps the same slot, index buffer and summary without one, so the
three phases, the memo and the layers' reference path run on any machine.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from backends.flashinfer import ops as fi_ops
from backends.flashinfer.ops import dtype_named
from backends.nsa_flashinfer.slots import SPARSE_POOL, SparseConfig, SparseHandle
from planner.ops import metadata_op

__all__ = ["nsa_flashinfer_plan", "sparse_config"]

nsa_flashinfer_plan = metadata_op(
    "nsa_flashinfer_plan",
    "Host op: plan FlashInfer's page-1 MLA over each row's top-k slots (row r's list at "
    "[r * topk, (r + 1) * topk), min(kv_len, topk) long) from host lengths; out = [rows, real "
    "rows, top-k tokens, longest].",
)


def sparse_config(params: dict[str, Any]) -> SparseConfig:
    """The op's resolved parameters as the (hashable) wrapper configuration, made once per
    distinct parameters (every replay asks)."""
    return _config(tuple(params.items()))


@functools.cache
def _config(items: tuple) -> SparseConfig:
    return _new_config(dict(items))


def _new_config(params: dict[str, Any]) -> SparseConfig:
    return SparseConfig(
        topk=params["topk"],
        next_n=params["next_n"],
        heads=params["heads"],
        latent=params["latent"],
        rope=params["rope"],
        q_dtype=dtype_named(params["q_dtype"], field="nsa_flashinfer.sparse_q_dtype"),
        kv_dtype=dtype_named(params["kv_dtype"], field="nsa_flashinfer.sparse_kv_dtype"),
        sm_scale=float(params["sm_scale"]),
        workspace_mb=params["workspace_mb"],
        backend=params["backend"],
    )


def _plan(
    use_flashinfer: bool, out: torch.Tensor, inputs: tuple, params: dict[str, Any]
) -> SparseHandle:
    """``inputs``: ``seq_lens_cpu, kv_indptr``; ``params`` the op's (a fresh dict per call,
    which this consumes: handed on, not unpacked into keywords again)."""
    static = params.pop("static")
    seq_lens_cpu, kv_indptr = inputs
    return SPARSE_POOL.plan(
        sparse_config(params),
        static=static,
        use_flashinfer=use_flashinfer,
        rows=kv_indptr.shape[0] - 1,
        seq_lens_cpu=seq_lens_cpu,
        out=out,
    )


@nsa_flashinfer_plan.provider("torch", graph_safe=False)
def _plan_bookkeeping(out: torch.Tensor, *inputs: torch.Tensor, **params: Any) -> SparseHandle:
    """No FlashInfer: the slot, its index buffer and the summary; layers run the reference."""
    return _plan(False, out, inputs, params)


# Looked up at call time (through FlashInfer's backend), so tests can stand a fake in on the CPU.
@nsa_flashinfer_plan.provider(
    "flashinfer", graph_safe=False, available=lambda d: fi_ops.flashinfer_usable(d)
)
def _plan_flashinfer(out: torch.Tensor, *inputs: torch.Tensor, **params: Any) -> SparseHandle:
    """Plan the slot's FlashInfer wrapper (graph wrapper for static views, else the eager one)."""
    return _plan(True, out, inputs, params)
