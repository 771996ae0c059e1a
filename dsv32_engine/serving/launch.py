"""``decode`` on several ranks: spawn (or join a ``torchrun`` job), serve, summarise per rank.

One process per rank, each with its own engine and planner. Under ``torchrun`` the
launch variables say who this process is; otherwise :func:`launch` spawns the ranks
locally through ``torch.multiprocessing`` (gloo on the CPU). Every rank prints a
one-line summary; rank 0 gathers them (one ``all_gather_object`` at the end), checks
what must agree across ranks, prints the aggregate and writes ``--json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv32_engine.distributed.group import (
    DistContext,
    env_rank,
    init,
    launched_by_torchrun,
    shutdown,
    spawn,
)
from dsv32_engine.serving.cli import Interrupted, StopRequest, error_line
from dsv32_engine.serving.memory_fit import allocation_errors
from dsv32_engine.serving.model_setup import model_config
from dsv32_engine.serving.rank_engines import RankEngine
from dsv32_engine.serving.report import summarize
from dsv32_engine.serving.run_config import RunConfig
from planner.errors import ConfigError, PlanError

KEPT = (
    "interrupted",
    "loop_steps",
    "requests_finished",
    "requests_unfinished",
    "generated_tokens",
    "wall_seconds",
    "tokens_per_second",
    "decode_tokens_per_second",
    "step_ms_p50",
    "step_ms_p99",
    "graph_replays",
    "debug",
    "verified_replays",
    "plan_write_checks",
    "eager_fallbacks",
    "ragged_steps",
    "steps_by_mode",
    "graph_kind",
    "device",
)


CPU_THREADS = 1
"""Intra-op threads of a CPU run when neither ``--threads`` nor ``OMP_NUM_THREADS`` says: the
tiny model's matrices are too small for a second thread to pay for its synchronisation, and
with a busy neighbour core every op waits for the thread that lost its core (measured on a
2-core machine: see the README's CPU timings)."""


def cpu_threads(requested: int | None, device: str, env: Mapping[str, str]) -> int | None:
    """The thread count a run sets (each rank its own), or None to keep torch's.

    ``--threads`` wins; an explicit ``OMP_NUM_THREADS`` is kept (torch read it at import);
    otherwise a CPU device gets :data:`CPU_THREADS`, a CUDA one torch's default.
    """
    if requested is not None:
        return requested
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return CPU_THREADS if torch.device(device).type == "cpu" else None


def rank_device(config: RunConfig, local_rank: int) -> str:
    """The device of one rank: ``cuda:LOCAL_RANK`` when the config says cuda."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config.device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            "more ranks on this host than GPUs",
            field="distributed",
            expected=f"<= {count} local ranks",
            actual=local_rank + 1,
        )
    return f"cuda:{local_rank}"


def aggregate(tp: int, dp: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole job's numbers, and the cross-rank agreements (``False`` is a failure).

    Rank ``r`` is TP rank ``r % tp`` of DP replica ``r // tp``. The TP ranks of a replica
    serve one workload together: its requests and tokens are counted once (TP rank 0's).
    Replicas serve disjoint requests: those add up.
    """
    wall = max(r["wall_seconds"] for r in ranks)
    served = ranks[::tp]
    generated = sum(r["generated_tokens"] for r in served)
    kinds = [k for k, n in (("tp", tp), ("dp_attention", dp)) if n > 1]
    out: dict[str, Any] = {
        "layout": "_x_".join(kinds),
        "world": len(ranks),
        "tp": tp,
        "dp_attention": dp,
        # Ctrl-C: every rank stopped before the same loop step (agreed), counts are of those
        "interrupted": any(r.get("interrupted", False) for r in ranks),
        "loop_steps": [r.get("loop_steps") for r in ranks],
        "requests_finished": sum(r["requests_finished"] for r in served),
        "generated_tokens": generated,
        "wall_seconds": wall,
        "tokens_per_second": generated / wall if wall else 0.0,
        # per rank, every runner's (the draft's too): what each rank's line says
        "graph_replays": [r["graph_replays"] for r in ranks],
        # debug mode: each replay, the draft's too, compared bit for bit with eager (a
        # mismatch raises), and forwards whose plans were digested for writes; None without
        # debug mode (nothing was checked)
        "verified_replays": [r["verified_replays"] for r in ranks],
        "plan_write_checks": [r.get("plan_write_checks") for r in ranks],
        "every_replay_verified": all(r["verified_replays"] == r["graph_replays"] for r in ranks)
        if all(r["debug"] for r in ranks)
        else None,
    }
    agree = []
    if tp > 1:
        replicas = [ranks[d * tp : (d + 1) * tp] for d in range(dp)]
        out["signature_checks"] = [r["signature_checks"] for r in ranks]
        out["digest_checks"] = [r["digest_checks"] for r in ranks]  # a mismatch raises
        out["checks_by_mode"] = ranks[0]["checks_by_mode"]
        out["digests_every_forward"] = all(
            r["digest_checks"] == r["signature_checks"] for r in ranks
        )
        out["tokens_equal_across_ranks"] = all(
            r["tokens"] == replica[0]["tokens"] for replica in replicas for r in replica
        )
        agree.append(out["tokens_equal_across_ranks"])
    if dp > 1:
        same = ("replays_by_size", "forwards_by_size", "ffn_exchanges", "loop_steps")
        out["idle_forwards"] = [r["idle_forwards"] for r in ranks]
        out["idle_by_shape"] = [r["idle_by_shape"] for r in ranks]
        out["peer_eager_forwards"] = [r["peer_eager_forwards"] for r in ranks]
        out["replays_by_size"] = ranks[0]["replays_by_size"]
        out["equal_across_ranks"] = {k: all(r[k] == ranks[0][k] for r in ranks) for k in same}
        agree.append(all(out["equal_across_ranks"].values()))
    out["agree"] = all(agree)
    return out


def _line(rank: dict[str, Any]) -> str:
    extra = {
        k: rank[k]
        for k in (
            "signature_checks",
            "digest_checks",
            "idle_forwards",
            "idle_by_shape",
            "peer_eager_forwards",
            "ffn_exchanges",
        )
        if k in rank
    }
    stopped = (
        f" (INTERRUPTED after {rank['loop_steps']} loop steps)" if rank.get("interrupted") else ""
    )
    return (
        f"rank {rank['rank']}/{rank['world']} ({rank['device']}){stopped}: "
        f"{rank['requests_finished']} requests, {rank['generated_tokens']} tokens, "
        f"{rank['tokens_per_second']:.1f} tok/s, {rank['graph_replays']} replays, "
        + ", ".join(f"{k} {v}" for k, v in extra.items())
    )


@allocation_errors  # an out-of-memory in a rank: its one line, as on one process
def serve_rank(
    config: RunConfig,
    ctx: DistContext,
    options: dict[str, Any],
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Build this rank's engine, serve, and return its summary (tokens included). ``stop``:
    Ctrl-C's request, agreed with the other ranks before a step (``RankEngine._stopping``)."""
    engine = RankEngine(config, ctx)
    result = engine.run(progress=False, keep_tokens=True, stop=stop)
    summary = {k: v for k, v in summarize(engine, result).items() if k in KEPT}
    summary.update(
        engine.rank_summary(),
        rank=ctx.rank,
        world=ctx.world,
        tokens={str(k): v for k, v in sorted(result.tokens.items())},
    )
    return summary


def rank_main(
    data: dict[str, Any],
    options: dict[str, Any],
    stop: StopRequest | None = None,
    launcher_stop: Any = None,
) -> None:
    """One rank's whole life (the target of :func:`spawn`, or the process under torchrun).

    Under torchrun ``stop`` is the CLI's Ctrl-C request of this process. A spawned rank
    makes its own (its repeats ignored: the launcher ends the ranks on a second Ctrl-C) and
    also reads ``launcher_stop``, the flag its launcher sets on Ctrl-C (a signal sent to the
    launcher alone, as ``kill -INT`` does, reaches no rank); SIGINT, blocked while it
    started, is let in once the request is installed.
    """
    if stop is None:
        stop = StopRequest(presses_to_abort=None)
        with stop.installed():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            _rank_life(data, options, stop, launcher_stop)
    else:
        _rank_life(data, options, stop, launcher_stop)


def _rank_life(
    data: dict[str, Any], options: dict[str, Any], stop: StopRequest, launcher_stop: Any
) -> None:
    def stopping() -> bool:
        return stop.requested or bool(launcher_stop is not None and launcher_stop.value)

    try:
        config = RunConfig.model_validate(data)
        rank, world, local = env_rank()
        if world != config.distributed.world:
            raise ConfigError(
                "the job's WORLD_SIZE differs from the configured ranks",
                field="distributed.tp" if config.distributed.tp > 1 else "distributed.dp_attention",
                expected=world,
                actual=config.distributed.world,
            )
        device = rank_device(config, local)
        config = config.model_copy(update={"device": device})
        if options.get("threads") is not None:  # resolved by the launcher: see cpu_threads
            torch.set_num_threads(options["threads"])
        d = config.distributed
        ctx = init(
            rank,
            world,
            torch.device(device),
            backend=d.backend,
            timeout_s=d.timeout_s,
            local_rank=local,
        )
        try:
            mine = serve_rank(config, ctx, options, stopping)
            for turn in range(world):  # one line per rank, in rank order
                if turn == rank:
                    sys.stdout.write(_line(mine) + "\n")
                    sys.stdout.flush()
                dist.barrier(group=ctx.host_group)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine, group=ctx.host_group)
        finally:
            shutdown()
        if rank == 0:
            _report(config.distributed.tp, config.distributed.dp_attention, every, options)
    except PlanError as exc:
        line = error_line(f"rank {os.environ.get('RANK')}: {exc}")
        print(line, file=sys.stderr, flush=True)
        sys.exit(2)


def _report(tp: int, dp: int, every: list[dict[str, Any]], options: dict[str, Any]) -> None:
    total = aggregate(tp, dp, every)
    print(
        "aggregate: " + json.dumps({k: v for k, v in total.items() if k != "replays_by_size"}),
        flush=True,
    )
    if options.get("json"):
        tokens = {rid: t for r in every for rid, t in r["tokens"].items()}
        ranks = [{k: v for k, v in r.items() if k != "tokens"} for r in every]
        data = {"aggregate": total, "ranks": ranks, "tokens": tokens}
        Path(options["json"]).write_text(json.dumps(data, indent=2))
    if not total["agree"]:
        print(error_line("ranks disagree (see the aggregate)"), file=sys.stderr, flush=True)
        sys.exit(1)


def check_layout(config: RunConfig) -> None:
    """What can be refused before any rank starts: TP ranks must divide the heads."""
    tp = config.distributed.tp
    heads = model_config(config.model).num_attention_heads
    if heads % tp:
        raise ConfigError(
            "tensor-parallel ranks must divide the attention heads",
            field="distributed.tp",
            expected=f"a divisor of num_attention_heads = {heads}",
            actual=tp,
        )


def launch(config: RunConfig, options: dict[str, Any], stop: StopRequest | None = None) -> int:
    """Run ``config.distributed.world`` ranks: this process as one under torchrun, else spawned.

    Ctrl-C (``stop``, the CLI's request): the ranks agree to stop before one loop step, each
    prints its line, rank 0 the aggregate (marked interrupted), then :class:`Interrupted`.
    Spawned ranks start with SIGINT blocked (their Python would otherwise raise in its
    imports); the launcher tells them through a shared flag, and on a second Ctrl-C kills
    them before it ends, leaving no process behind.
    """
    check_layout(config)
    if launched_by_torchrun():
        rank_main(config.model_dump(), options, stop)
        _raise_if_stopped(stop)
        return 0
    _raise_if_stopped(stop, "before any rank started")
    flag = mp.get_context("spawn").RawValue("b", 0)
    if stop is not None:
        stop.on_request.append(lambda: setattr(flag, "value", 1))
    # Started now, not by the first rank's start: starting it unblocks SIGINT (bpo-33613),
    # and the ranks started after that would inherit SIGINT unblocked.
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # children inherit it
    try:
        args = (config.model_dump(), options, None, flag)
        context = spawn(rank_main, config.distributed.world, args, join=False)
        if stop is not None:  # the second Ctrl-C
            stop.on_abort.append(lambda: _kill(context.processes))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C meanwhile lands now
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        return int(exc.exit_code or 1)
    _raise_if_stopped(stop)
    return 0


def _kill(processes: list[Any]) -> None:
    """Every rank still running killed, and reaped: nothing of the job outlives the launcher."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def _raise_if_stopped(stop: StopRequest | None, when: str | None = None) -> None:
    if stop is not None and stop.requested:
        raise Interrupted(
            when
            or "every rank stopped before the same loop step; the lines above cover the "
            "steps that ran"
        )
