"""The staging pull: the kernel equals its torch reference on random rings (under the Triton
interpreter), and the ring's protocol pulls each step's slot once, refuses a launch it was
not told of, and names a graph that ran without its replay."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs.staging_pull import SLOTS, PulledRing, pull_reference
from planner.errors import ReplayError
from tests.support.kernels import DEVICE


def _state(words: int, seq: int, tags: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(-(2**31), 2**31 - 1, (SLOTS, words), dtype=torch.int32, generator=gen)
    meta = torch.zeros(2 + SLOTS, dtype=torch.int64)
    meta[2:] = torch.tensor(tags, dtype=torch.int64)
    counter = torch.tensor([seq], dtype=torch.int64)
    dst = torch.randint(-100, 100, (words + 3,), dtype=torch.int32, generator=gen)
    return block, meta, counter, dst


@settings(max_examples=40, deadline=None)
@given(
    words=st.integers(1, 5000),
    seq=st.integers(0, 10**12),
    kind=st.sampled_from(["pull", "sent", "stale", "ahead", "never filled"]),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.triton(device=DEVICE)
def test_the_pull_kernel_equals_its_reference(words, seq, kind, seed):
    """Every tag the ring writes, or finds stale, on slots wider than one pass of the kernel.
    On a GPU host the kernel reads pinned host memory into device memory, as in a graph."""
    from graphs.staging_pull_kernel import pull_kernel

    tag = {
        "pull": 2 * seq,
        "sent": 2 * seq + 1,
        "stale": 2 * max(seq - SLOTS, 0) if seq >= SLOTS else 2 * seq + 2 * SLOTS,
        "ahead": 2 * (seq + SLOTS),
        "never filled": -2,
    }[kind]
    tags = [2 * (seq + 1 + i) for i in range(SLOTS)]
    tags[seq % SLOTS] = tag
    want = _state(words, seq, tags, seed)
    cuda = DEVICE.type == "cuda"
    got = [t.pin_memory() if cuda and i < 2 else t.clone().to(DEVICE) for i, t in enumerate(want)]
    pull_reference(*want)
    pull_kernel()[(1,)](*got, words, SLOTS=SLOTS, BLOCK=2048)
    got = [t.cpu() for t in got]
    for name, a, b in zip(("block", "meta", "counter", "dst"), got, want):
        assert torch.equal(a, b), name
    assert int(want[2][0]) == seq + 1 and int(want[1][0]) == seq + 1  # counter and ack
    assert (int(want[1][1]) == 0) == (kind in ("pull", "sent"))


def test_the_reference_copies_only_a_slot_staged_for_its_step():
    block, meta, counter, dst = _state(7, 3, [2 * i for i in range(SLOTS)], 0)
    before = dst.clone()
    pull_reference(block, meta, counter, dst)
    assert torch.equal(dst[:7], block[3]) and torch.equal(dst[7:], before[7:])
    meta[2 + 4] = 2 * 4 + 1  # already sent: the buffer is left alone
    before = dst.clone()
    pull_reference(block, meta, counter, dst)
    assert torch.equal(dst, before) and int(meta[1]) == 0
    pull_reference(block, meta, counter, dst)  # step 5 finds step 5's tag: copied
    assert torch.equal(dst[:7], block[5]) and int(meta[1]) == 0
    before = dst.clone()
    meta[2 + 6] = 2 * (6 - SLOTS)  # step 6 finds an old step's tag
    pull_reference(block, meta, counter, dst)
    assert int(meta[1]) == 7 and torch.equal(dst, before)


def _ring(words: int = 5) -> tuple[PulledRing, torch.Tensor]:
    return PulledRing(words, torch.device("cpu"), "decode"), torch.zeros(words, dtype=torch.int32)


def test_each_step_pulls_its_own_slot_round_the_ring():
    ring, dst = _ring()
    for step in range(3 * SLOTS):
        row, view = ring.slot()
        view[:] = step
        ring.publish(sent=False)
        ring.pull(dst)  # the graph's launch
        ring.launched()
        assert dst.tolist() == [step] * 5
    assert ring.seq == 3 * SLOTS and ring.waits == 0


def test_a_replay_again_before_the_launch_overwrites_its_slot():
    ring, dst = _ring()
    for value in (1, 2):
        _, view = ring.slot()
        view[:] = value
        ring.publish(sent=False)
    ring.pull(dst)
    ring.launched()
    assert dst.tolist() == [2] * 5


def test_a_sent_step_is_left_to_its_copy():
    ring, dst = _ring()
    dst[:] = 9
    ring.slot()
    ring.publish(sent=True)
    ring.pull(dst)
    ring.launched()
    assert dst.tolist() == [9] * 5
    ring.slot()  # no error: the pull found its step's tag


def test_a_launch_without_a_replay_is_refused():
    ring, _ = _ring()
    with pytest.raises(ReplayError) as err:
        ring.launched()
    assert err.value.field == "graph_launched"


def test_a_graph_run_twice_is_named_and_the_ring_resynchronised():
    ring, dst = _ring()
    _, view = ring.slot()
    view[:] = 4
    ring.publish(sent=False)
    ring.pull(dst)
    ring.pull(dst)  # launched again by someone else, with no replay
    ring.launched()
    with pytest.raises(ReplayError, match="ran without its replay") as err:
        ring.slot()
    assert err.value.field == "graph_launched"
    assert ring.seq == 2  # the device's count
    _, view = ring.slot()
    view[:] = 6
    ring.publish(sent=False)
    ring.pull(dst)
    ring.launched()
    assert dst.tolist() == [6] * 5
    ring.slot()


def test_launches_declared_for_a_graph_that_never_pulls_are_refused():
    ring, _ = _ring()
    for _ in range(SLOTS):
        ring.slot()
        ring.publish(sent=False)
        ring.launched()  # a graph captured without record(): nothing pulls
    with pytest.raises(ReplayError, match="does not run the planner's record") as err:
        ring.slot()
    assert err.value.field == "graph_launched"
