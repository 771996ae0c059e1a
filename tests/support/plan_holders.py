"""Ways a caller keeps an eager plan's memory readable, for the tests of recycled memory
(``planner.fresh_pool``): each holder keeps one field readable after the plan set is
dropped, and reads it back."""

from __future__ import annotations

import torch

A = [100, 50, 20]
OTHERS = [[100, 7, 3], [99, 98, 97], [1, 2, 100]]  # the same longest request: A's layout


def fields_of(plans) -> list[tuple[str, str]]:
    return [(b, name) for b, plan in plans.items() for name in plan.tensors()]


def tensor_of(plans, field: tuple[str, str]) -> torch.Tensor:
    return plans[field[0]].tensors()[field[1]]


def _hold_plans(plans, field):
    return plans, lambda: tensor_of(plans, field)


def _hold_tensor(plans, field):
    t = tensor_of(plans, field)
    return t, lambda: t


def _tail(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)[1:]


def _hold_view(plans, field):
    v = _tail(tensor_of(plans, field))
    return v, lambda: v


def _hold_numpy(plans, field):
    a = tensor_of(plans, field).numpy()
    return a, lambda: torch.from_numpy(a)


def _hold_storage(plans, field):
    t = tensor_of(plans, field)  # only the storage is kept: the tensor itself dies here
    s, offset, shape, stride, dtype = (
        t.untyped_storage(),
        t.storage_offset(),
        t.shape,
        t.stride(),
        t.dtype,
    )
    del t
    return s, lambda: torch.empty(0, dtype=dtype, device=s.device).set_(s, offset, shape, stride)


def _hold_dlpack(plans, field):
    capsule = torch.utils.dlpack.to_dlpack(tensor_of(plans, field))
    holder = {"capsule": capsule}

    def read():  # a capsule is consumed once: read it back into a tensor the first time
        if "tensor" not in holder:
            holder["tensor"] = torch.utils.dlpack.from_dlpack(holder.pop("capsule"))
        return holder["tensor"]

    return holder, read


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


HOLDERS = {  # how a field's memory is kept readable, and what of the field it reads
    "the plan set": (_hold_plans, _whole),
    "one tensor": (_hold_tensor, _whole),
    "a view of it": (_hold_view, _tail),
    "a numpy array of it": (_hold_numpy, _whole),
    "its storage": (_hold_storage, _whole),
    "a DLPack capsule of it": (_hold_dlpack, _whole),
}
