"""Process groups: who this rank is, which backend carries what, and how ranks are launched.

Two groups, as SGLang keeps them: the *device* group (NCCL on GPUs, gloo on the CPU)
carries tensors the model exchanges inside the forward (and inside CUDA graphs); the
*host* group (always gloo) carries the per-step agreement of batch signatures, sizes
and digests, which live on the host: sending them over NCCL would copy them to the
GPU and back and synchronise every step. On the CPU both are the default gloo group.

Every group has a timeout, so a rank that skipped a collective shows up as an error
on its peers instead of a hang. Ranks come from ``torchrun`` (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or from :func:`spawn`, which starts
``world`` local processes through ``torch.multiprocessing`` with a free port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job and the groups it talks through."""

    rank: int
    world: int
    backend: str
    """The device group's backend (``nccl`` or ``gloo``)."""
    device: torch.device
    """Where this rank's model and plans live (``cuda:LOCAL_RANK`` with NCCL)."""
    timeout_s: float
    device_group: Any = None
    """``None``: the default group (which is what it is); kept as ``None`` so nothing holds
    the default group's object past :func:`shutdown`."""
    host_group: Any = None
    """The gloo group of per-step metadata: its own group under NCCL, else ``None`` (the
    default group, gloo already)."""


def backend_for(device: torch.device, requested: str = "auto") -> str:
    """NCCL for CUDA devices, gloo for the CPU; a forced backend must fit the device."""
    if requested not in BACKENDS:
        raise ConfigError(
            "unknown backend", field="distributed.backend", expected=BACKENDS, actual=requested
        )
    want = "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(
            "NCCL carries CUDA tensors only",
            field="distributed.backend",
            expected="gloo (or auto) on the CPU",
            actual=requested,
        )
    return want if requested == "auto" else requested


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launch variables of ``torchrun`` are all set (this process is one rank)."""
    env = os.environ if env is None else env
    return all(key in env for key in LAUNCH_ENV)


def env_rank(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from the launch variables, checked."""
    env = os.environ if env is None else env
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = env.get(key, env.get("RANK", "0") if key == "LOCAL_RANK" else "")
        try:
            values[key] = int(text)
        except ValueError:
            raise ConfigError("not an integer", field=key, actual=text) from None
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            "needs 0 <= RANK < WORLD_SIZE", field="RANK", expected=f"0..{world - 1}", actual=rank
        )
    return rank, world, values["LOCAL_RANK"]


def init(
    rank: int,
    world: int,
    device: torch.device,
    *,
    backend: str = "auto",
    timeout_s: float = 300.0,
    local_rank: int | None = None,
    init_method: str = "env://",
) -> DistContext:
    """Join the job: the default (device) group, and a gloo host group when it is NCCL."""
    chosen = backend_for(device, backend)
    if device.type == "cuda":
        device = torch.device("cuda", rank if local_rank is None else local_rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if chosen == "nccl" else {}
    dist.init_process_group(
        chosen, init_method=init_method, rank=rank, world_size=world, timeout=timeout, **kwargs
    )
    host = dist.new_group(backend="gloo", timeout=timeout) if chosen != "gloo" else None
    return DistContext(rank, world, chosen, device, timeout_s, None, host)


def split(ctx: DistContext, tp: int, dp: int) -> tuple[DistContext | None, DistContext | None]:
    """This rank's tensor-parallel and data-parallel groups in a job of ``tp x dp`` ranks.

    Rank ``r`` is TP rank ``r % tp`` of DP replica ``r // tp``: its TP group is the ``tp``
    ranks of its replica (the heads' all-reduce, the per-forward checks), its DP group the
    ``dp`` ranks with its TP rank, one per replica (the FFN's row exchange, the per-step
    agreement: TP peers hold the same rows and derive the same decisions). A dimension of
    one has no group (``None``); when the other is the whole job, its group is ``ctx``.
    ``new_group`` is collective: every rank creates every group, in the same order.
    """
    if tp * dp != ctx.world:
        raise ConfigError(
            "tp x dp_attention must be the job's ranks",
            field="distributed",
            expected=f"{ctx.world} ranks",
            actual=f"tp {tp} x dp_attention {dp}",
        )
    if tp == 1 or dp == 1:
        return (ctx if tp > 1 else None), (ctx if dp > 1 else None)
    tp_ctx = _subgroups(ctx, [[d * tp + t for t in range(tp)] for d in range(dp)])
    dp_ctx = _subgroups(ctx, [[d * tp + t for d in range(dp)] for t in range(tp)])
    return tp_ctx, dp_ctx


def _subgroups(ctx: DistContext, partition: list[list[int]]) -> DistContext:
    """The context of this rank's part of ``partition`` (every part created on every rank;
    a gloo host twin beside each NCCL part)."""
    timeout = timedelta(seconds=ctx.timeout_s)
    mine: DistContext | None = None
    for ranks in partition:
        device = dist.new_group(ranks, timeout=timeout)
        host = (
            dist.new_group(ranks, backend="gloo", timeout=timeout)
            if ctx.backend != "gloo"
            else device
        )
        if ctx.rank in ranks:
            mine = dataclasses.replace(
                ctx,
                rank=ranks.index(ctx.rank),
                world=len(ranks),
                device_group=device,
                host_group=host,
            )
    if mine is None:
        raise ConfigError("a partition of the ranks misses this one", field="rank", actual=ctx.rank)
    return mine


def shutdown() -> None:
    """Leave the job (a no-op when it was never joined).

    Garbage is collected first: an engine lives in a reference cycle (its runner holds its
    bound forward), and a gloo group still referenced from one was destroyed at interpreter
    exit with its threads running, which aborts the process. Then a barrier: a rank that
    closes its connections while a peer's transport still talks to it made that peer abort
    at exit too (both seen on the CPU, about one run in five). A group already broken (a
    peer timed out) cannot pass a barrier and is destroyed as it is.
    """
    gc.collect()
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of a local spawn)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    fn(*args)


def spawn(
    fn: Callable[..., Any], world: int, args: tuple = (), *, join: bool = True
) -> mp.ProcessContext | None:
    """Run ``fn(*args)`` in ``world`` fresh processes, each with the torchrun variables set.

    Raises (with the failing rank's traceback) when any rank fails; the others are
    then stopped by ``torch.multiprocessing``. ``join=False`` returns the processes'
    context at once, for a launcher that joins them itself (and stops them on Ctrl-C).
    """
    if world < 1:
        raise ConfigError("at least one rank", field="world", expected=">= 1", actual=world)
    return mp.start_processes(
        _entry, args=(world, free_port(), fn, args), nprocs=world, join=join, start_method="spawn"
    )


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """Every rank's ``tensor`` concatenated along dim 0 into ``out`` (one collective).

    ``all_gather_single`` where this torch has it (2.13 deprecates the old name),
    ``all_gather_into_tensor`` otherwise (the GPU image's 2.11).
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)
