"""Refuse a layer's in-place write into a plan, always on: torch's version counters.

Layers only read plans. A layer that writes one (``plans["nsa"].seq_lens.add_(1)``)
corrupts every later layer of the step, and under a graph every replay: the graph repeats
the write. torch has no read-only tensor, so the write cannot be stopped where it happens;
it is seen right after the forward instead, for microseconds of host time and no GPU sync.

**How.** Every in-place op and ``out=`` write that goes through torch's dispatcher (on the
CPU or a GPU, eager or under CUDA graph capture, under ``no_grad`` or ``inference_mode``)
adds one to the written tensor's version counter, ``Tensor._version``, shared with its
views. :func:`refuse_plan_writes` reads the counter of every plan tensor before the
forward and again after it, and raises ``PlanWriteError`` naming ``backend.field`` when
one moved. The counting happens when an op is dispatched, on the host, so a write made at
graph capture is counted though nothing runs on the GPU then: catching it at capture
catches it for every replay of that graph (``graphs.runner`` watches each capture's
forward and each eager one). Seen on an H100 (torch 2.11): an ``add_`` and an ``out=``
write under ``torch.cuda.graph`` moved the field's counter by 2 and left the memory as it
was; the replay changed the memory and moved no counter. Each plan field has a counter of its own, even where fields
are cut from one buffer (``planner.plans.build_plans`` gives each field its own tensor
over the same memory), so the error names the field the layer wrote through.

``_version`` is torch's and underscored: it is read here and nowhere else in the project,
and ``tests/graphs/test_plan_writes.py`` fails the day torch stops counting a kind of write
this module relies on.

**What it cannot see** (debug mode's content digests, ``planner.debug.guard``, still
catch these; ``PLANNER_DEBUG=1``): writes that bypass the dispatcher (Triton or other
raw-pointer kernels, ``tensor.numpy()`` or ``.data`` writes, DLPack views), writes during a
CUDA graph's replay (nothing runs on the host then; the layer's Python ran at capture),
and writes inside ``torch.inference_mode()`` into plans made under it (inference tensors
count nothing there; plans made outside it count writes made inside it too).

**Chosen over** a tensor subclass with ``__torch_function__`` (or a ``TorchFunctionMode``
around the forward), which would name the op that writes as it happens but costs Python
on every op a layer runs on a plan tensor, and DeepSeek-V3.2's 61 layers each read several
fields: a passthrough subclass took 6.9 us per ``torch.add`` of 128 int32 against 2.8 us
plain, 4.8 against 1.0 us per slice. It would also change the type kernels receive, and
see nothing inside a CUDA graph's replay either. The watch costs per forward, not per op:
5 us for the 13 fields of the tiny DeepSeek-V3.2 engine's decode plan, against 277 us for
the eager plan itself, which the fields' own counters (``Tensor.data`` per field in
``build_plans``) make 4 us slower. Measured with ``timeit`` (best of 9) on the 2-core CPU
development machine under a load average of 2.5, torch 2.13, one thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from planner.errors import PlanWriteError
from planner.schema import Plan


def plan_tensors(plans: Mapping[str, Plan]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor field of ``plans`` with its ``backend.field`` (a stepped plan set's
    ``backend@s.field``)."""
    return [
        (f"{backend}.{name}", getattr(plan, name))
        for backend, plan in plans.items()
        for name in plan.tensor_specs
    ]


@contextmanager
def refuse_plan_writes(plans: Mapping[str, Plan], where: str = "the forward") -> Iterator[None]:
    """Raise ``PlanWriteError`` naming ``backend.field`` if the body wrote in place into a
    tensor of ``plans`` (``where`` says which forward, for the message). An error raised by
    the body passes through unchecked. Names are made only when something was written."""
    tensors = [getattr(plan, name) for plan in plans.values() for name in plan.tensor_specs]
    try:
        before = [tensor._version for tensor in tensors]
    except RuntimeError:  # "Inference tensors do not track version counter": leave them out
        tensors = [tensor for tensor in tensors if not tensor.is_inference()]
        before = [tensor._version for tensor in tensors]
    yield
    if [tensor._version for tensor in tensors] != before:
        counted = {id(t): v for t, v in zip(tensors, before, strict=True)}
        written = [
            key
            for key, tensor in plan_tensors(plans)
            if id(tensor) in counted and tensor._version != counted[id(tensor)]
        ]
        raise PlanWriteError(
            f"{where} wrote in place into a plan it may only read (layers must not modify "
            "plans: clone a field to change it)",
            field=written[0],
            actual=written if len(written) > 1 else None,
        )
