"""The replay lane: a uniform host batch's replay in one pass over its tensors, and its
host ops around the one copy (those whose small output lives in the staging buffer's
appendix before it, writing there, the others after it, as in the general replay).

Why: a screened replay read every batch tensor twice, once at the door (type, dtype, rank,
device, contiguity, length) and once more to hand the compiled screen its kinds and
addresses, and it looked its captured size, ranges and segment table up again on every
call. The lane does the door's checks and the screen's reads in one pass, over what a
capture fixed: the token table's address and shape, the size, the screen's constant
arguments. On anything it does not recognise as exactly right it says "not mine" (False,
before anything is sent), and the general replay runs; its door names what is wrong.

So the lane never accepts what the door refuses: every check of ``validate_batch`` that
applies to a decode or verify batch is here, as the same comparison or a stricter one (an
exact ``torch.Tensor``, where the door takes subclasses). Tests hold it to that on random
and hostile batches, and hold its plans to a fresh eager plan's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from planner.batch import BATCH, ForwardBatch, ForwardMode
from planner.captured import CapturedBatch, run_calls
from planner.lane_door import host_sources, table_on

LANE_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY})
"""Modes whose batches may take the lane: uniform, one step, lengths implied."""


class ReplayLane:
    """One captured (mode, size)'s replay hot path; see the module docstring."""

    __slots__ = (
        "captured",
        "plans",
        "mode",
        "bs",
        "next_n",
        "device",
        "on_host",
        "table_ptr",
        "table_shape",
        "stager",
        "screen",
        "steps",
        "staged",
        "later",
        "pull",
        "_mirrors",
    )

    def __init__(
        self,
        captured: CapturedBatch,
        mode: ForwardMode,
        next_n: int,
        device: torch.device,
    ) -> None:
        stager = captured.storages[0].stager
        bs = captured.plans.reqs
        self.captured, self.plans, self.mode, self.bs = captured, captured.plans, mode, bs
        self.next_n, self.device = next_n, device
        self.on_host = device.type == "cpu"  # cpu:0 included, as at the door
        self.table_ptr, self.table_shape = captured.table_ptr, captured.table_shape
        self.stager = stager
        self.steps = captured.program_steps
        self.screen = stager.layout.screen.bind(
            captured.ranges, bs, captured.dims["tokens"], next_n
        )
        # host calls whose output lives in the staging appendix, written there before the
        # copy (their handles' own replay can); the others run after it, as in general
        appendix = captured.storages[0].staged
        self.staged = tuple(
            (call, appendix[call.output])
            for call in captured.host_calls
            if call.output in appendix and call.fast is not None
        )
        staged = {call.output for call, _ in self.staged}
        self.later = tuple(call for call in captured.host_calls if call.output not in staged)
        self.pull = stager.pull if stager.pull is not None and self._pullable() else None
        """The ring the graph pulls this capture's inputs from, where it may: see
        :meth:`_pullable`; None sends them by the copy, as without one."""
        self._mirrors: dict[int, tuple[torch.Tensor, tuple[np.ndarray, ...]]] = {}

    def _pullable(self) -> bool:
        """Whether the graph may pull the staged inputs itself, after every host op ran: no
        host op reads the device buffer (each reads the batch, or binds a field's address
        without reading it; a device op hoisted out of the graph would read it), and none
        writes the appendix on the device (the pull would overwrite that with the slot)."""
        appendix = self.captured.storages[0].staged
        for step in self.captured.host_steps:
            if step.chain.current.graph_safe:
                return False
            if any(who != BATCH and name not in step.spec.binds for who, name in step.input_keys):
                return False
        return not any(call.output in appendix for call in self.later)

    @classmethod
    def for_capture(
        cls,
        captured: CapturedBatch,
        mode: ForwardMode,
        next_n: int,
        device: torch.device,
    ) -> ReplayLane | None:
        """The lane of a capture, or None where its replays cannot take one (stepped or
        ragged modes, no compiled screen)."""
        if mode not in LANE_MODES or not captured.screened:
            return None
        return cls(captured, mode, next_n, device)

    def _mirror(self, view: np.ndarray) -> tuple[np.ndarray, ...]:
        """The staged outputs' places in one pinned buffer of the ring (made once per buffer)."""
        at = self.stager.appendix_at
        return tuple(output.host_view(view, at) for _, output in self.staged)

    def run(self, batch: ForwardBatch) -> bool:
        """Stage ``batch`` into the capture's buffers, check the plans did not move, and mark
        them: True when done (the caller counts the replay, with its time); False, with
        nothing sent, where the general replay must run."""
        sources = host_sources(batch, self.next_n)
        if sources is None:
            return False
        seq, real, pool_kind, pool, slot_kind, slot, pos_kind, pos = sources
        if real > self.bs:  # too large: the door's message
            return False
        table = batch.req_to_token
        if not (
            table_on(table, self.device, self.on_host)
            and table.data_ptr() == self.table_ptr
            and table.shape == self.table_shape
        ):
            return False
        staged = self.staged
        for call, _ in staged:
            if call.chain.current is not call.provider:  # a fallback since capture
                return False
        stager = self.stager
        pull = self.pull
        if pull is None:
            host, view, done = stager.next_host()
        else:  # the graph pulls this slot itself: nothing to send here
            (host, view), done = pull.slot(), None
        seq_ptr = seq.data_ptr()
        if not self.screen.run(
            host.data_ptr(), seq_ptr, pool_kind, pool, slot_kind, slot, pos_kind, pos, real
        ):
            return False
        handles = {}
        if staged:
            mirrors = self._mirrors.get(id(host))
            if mirrors is None or mirrors[0] is not host:
                mirrors = self._mirrors[id(host)] = (host, self._mirror(view))
            for (call, _), mirror in zip(staged, mirrors[1]):
                try:
                    handle = call.fast(call.args_for(batch), mirror)
                except Exception:  # noqa: BLE001  (nothing sent: the general path runs it
                    return False  # again, through its chain, which names or retires it)
                if handle is not None:
                    handles[call.output] = handle
        if pull is None:
            stager.send(host, stager.device_buf, done)
        else:
            pull.publish(sent=False)
        run_calls(self.later, batch, handles)  # host ops that write the device: after it
        self.captured.steps[0].check_unmoved(handles)
        plans = self.plans  # one step: what PlanSet.mark sets, without its loop over steps
        plans.phase, plans.mode, plans.real_reqs = "replay", self.mode, real
        return True


def lane_for(
    lanes: Mapping[tuple[ForwardMode, int], ReplayLane], batch: object, bs: object
) -> ReplayLane | None:
    """The lane a replay of ``batch`` at size ``bs`` may take. Exact types only: a bool or a
    float size (equal to an int as a key), a string or unhashable mode go the general way,
    whose door names them."""
    if (
        bs.__class__ is int
        and batch.__class__ is ForwardBatch
        and batch.mode.__class__ is ForwardMode
    ):
        return lanes.get((batch.mode, bs))
    return None
