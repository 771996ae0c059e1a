"""What the engine runs, resolved from its run config: the ragged token buckets, the KV bound
of a captured ragged batch, how staged inputs reach the device, and whether the loop runs one
step ahead. Each is a pure function of the config (and the device or cache size it names)."""

from __future__ import annotations

import torch

from dsv32_engine.serving.run_config import PlannerSection, RunConfig
from planner.errors import ConfigError


def ragged_token_sizes(config: RunConfig) -> list[int] | bool | None:
    """The runner's ragged token buckets: None (extend and mixed batches run eagerly), True
    (the default ladder) or the configured list (``graphs.ragged``, ``graphs.token_sizes``)."""
    if not config.ragged_graphs:
        return None
    return config.graphs.token_sizes if config.graphs.token_sizes is not None else True


def ragged_kv_bound(p: PlannerSection, kv_slots: int) -> int:
    """The KV a captured ragged batch may hold (``planner.ragged_kv_tokens``): by default
    what the KV cache holds, at most ``max_batch`` requests of ``max_context``. Every request
    of this engine owns its pages (no prefix is shared), so no batch's lengths sum past the
    cache: a step past this bound cannot happen, and the flat KV buffers it sizes (about 140
    bytes a token: a slot and an index key) stay a few percent of the cache's bytes."""
    if p.ragged_kv_tokens is not None:
        return p.ragged_kv_tokens
    return min(p.max_batch * p.max_context, kv_slots)


def stages_in_graph(p: PlannerSection) -> bool:
    """Whether the captured graphs pull each replay's staged inputs themselves
    (``planner.staging_in_graph``; ``auto``: whenever the ops run in the graph)."""
    return p.ops_in_graph if p.staging_in_graph == "auto" else bool(p.staging_in_graph)


def resolve_overlap(
    setting: bool | str, device: torch.device, speculative: bool
) -> tuple[bool, str]:
    """Whether the loop runs one step ahead (``loop.overlap``), and why, for the summary."""
    if speculative:
        if setting is True:
            raise ConfigError(
                "speculative decoding runs the synchronous loop: each round's lengths, slots "
                "and next drafts follow from the accepted drafts the host reads",
                field="loop.overlap",
                expected="false or auto with speculative.draft set",
                actual=True,
            )
        return False, "speculative decoding reads each round before the next"
    if setting == "auto":
        on = device.type == "cuda"
        return on, "auto: on CUDA" if on else "auto: off on the CPU (no device to run ahead of)"
    return bool(setting), "loop.overlap"
