"""A layer that writes into a plan is named, always, by torch's count of in-place writes.

``graphs.plan_writes`` reads ``Tensor._version``, an underscored attribute of torch: the
first test fails loudly the day torch stops counting a kind of write the watch relies on.
The runner watches every eager forward and every capture's (the catalogue,
``tests/planner/test_bad_input_catalogue.py``, holds both refusals); debug mode's content
digests still catch what torch does not count.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from graphs import GraphRunner, GraphWarning
from graphs.plan_writes import refuse_plan_writes
from planner import ForwardMode, PlanWriteError
from tests.support.graph_model import Scheduler, TinyPagedModel
from tests.support.planners import PlannerSetup

SETUP = PlannerSetup(("paged",), 8, 32, 4, pool=12)
SLOTS = 12 * 32


def _writes() -> dict[str, object]:
    """Every kind of write a layer makes through torch, each on a fresh int32 tensor."""
    return {
        "in-place op": lambda t: t.add_(1),
        "slice of a view": lambda t: t[1:].view(-1)[:1].mul_(2),
        "item assignment": lambda t: t.__setitem__(0, 7),
        "out=": lambda t: torch.add(t, 1, out=t),
        "copy_": lambda t: t.copy_(torch.ones_like(t)),
        "index_put_": lambda t: t.index_put_(
            (torch.tensor([0]),), torch.tensor([3], dtype=t.dtype)
        ),
        "under no_grad": lambda t: _under(torch.no_grad(), lambda: t.add_(1)),
        "under inference_mode": lambda t: _under(torch.inference_mode(), lambda: t.add_(1)),
    }


def _under(mode, write) -> None:
    with mode:
        write()


@pytest.mark.parametrize("kind", sorted(_writes()))
def test_torch_still_counts_every_write_the_watch_relies_on(kind):
    """The library contract ``graphs.plan_writes`` stands on: every write through torch adds
    to the written tensor's ``_version`` (shared with its views), and ``Tensor.data``, how
    the planner gives each field a counter of its own, does not share it."""
    buffer = torch.zeros(8, dtype=torch.int32)
    field, neighbour = (part.data for part in buffer.split_with_sizes([4, 4]))
    before = field._version, neighbour._version
    _writes()[kind](field)
    assert field._version > before[0], f"torch no longer counts a write by {kind}"
    assert neighbour._version == before[1], "Tensor.data no longer has a counter of its own"


def _plans():
    return SETUP.planner().plan(SETUP.batch(random.Random(0), bs=3))


def test_the_watch_names_the_field_written_and_lets_reads_and_errors_through():
    plans = _plans()
    plan = plans["paged"]
    with refuse_plan_writes(plans):
        (plan.kv_lens + 1).add_(1)  # a copy: the layer's own
        plan.page_table.long().sum()
    with pytest.raises(PlanWriteError) as err, refuse_plan_writes(plans, "the test's forward"):
        plan.token_slots[0, :2] = 0
    assert err.value.field == "paged.token_slots"
    assert str(err.value).startswith("[paged.token_slots] the test's forward wrote in place")
    with pytest.raises(ZeroDivisionError), refuse_plan_writes(plans):
        plan.kv_lens.add_(1)
        raise ZeroDivisionError  # the forward's own error, not the watch's
    with pytest.raises(PlanWriteError) as err, refuse_plan_writes(plans):
        plan.page_table.add_(1)
        plan.cu_seqlens_k.add_(1)
    assert err.value.field == "paged.cu_seqlens_k"  # the first in plan order, and the list
    assert "paged.page_table" in str(err.value)


def test_plans_made_under_inference_mode_do_not_break_the_watch():
    """Inference tensors count no writes inside inference mode: such a write passes (debug
    mode's digests still see it; outside inference mode torch refuses the write itself). A
    hand-built plan of raw inference tensors, whose count torch refuses to read, is left
    out, not an error."""
    with torch.inference_mode():
        plans = _plans()
        kv_lens = plans["paged"].kv_lens.clone()
    assert plans["paged"].kv_lens.is_inference()
    with refuse_plan_writes(plans), torch.inference_mode():
        plans["paged"].kv_lens.add_(1)
    raw = {"paged": plans["paged"].model_copy(update={"kv_lens": kv_lens})}
    with refuse_plan_writes(raw):
        pass


def _runner(forward, *, debug: bool = False, **kw) -> GraphRunner:
    return GraphRunner(
        SETUP.planner(debug=debug),
        forward,
        req_to_token=SETUP.table,
        static_inputs={"input_ids": torch.int64},
        sizes=[2, 4],
        **kw,
    )


def test_a_write_at_capture_fails_the_capture_once_not_every_size():
    """A layer's write is a bug of the forward, the same at every size: raised, not a size
    dropped per size with a warning and its batches sent eagerly."""
    model = TinyPagedModel(SLOTS)

    def writes(inputs, plans):
        plans["paged"].seq_lens[:1] += 1
        return model(inputs, plans)

    runner = _runner(writes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(PlanWriteError) as err:
            runner.capture()
    assert err.value.field == "paged.seq_lens"
    assert "at graph capture" in str(err.value) and "\n" not in str(err.value)
    assert runner.stats.dropped == {}


def test_a_forward_that_writes_only_its_own_memory_passes_in_every_phase():
    """The model writes its KV cache (``index_copy_``) in every layer, at capture, at each
    replay and eagerly (a batch past the largest size): none of it is a plan's."""
    runner = _runner(TinyPagedModel(SLOTS))
    sched = Scheduler(SETUP.table, next_n=1, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # the eager fallback of the batch of 6
        for bs in (1, 3, 6, 2):
            runner.step(*sched.batch(bs, ForwardMode.DECODE))
    assert sum(runner.stats.replays.values()) == 3 and sum(runner.stats.eager.values()) == 1


def test_debug_mode_catches_a_write_torch_does_not_count():
    """A write through ``.numpy()`` (as a Triton or raw-pointer kernel writes on a GPU)
    bypasses torch's dispatcher: no count moves, the digests of debug mode name it."""
    model = TinyPagedModel(SLOTS)

    def writes_raw(inputs, plans):
        plans["paged"].kv_lens.numpy()[0] += 1
        return model(inputs, plans)

    sched = Scheduler(SETUP.table, next_n=1, seed=0)
    batch, inputs = sched.batch(3, ForwardMode.DECODE)
    quiet = _runner(writes_raw, enabled=False)
    loud = _runner(writes_raw, enabled=False, debug=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # graphs off: the steps run eagerly
        quiet.step(batch, inputs)  # the watch cannot see it: this is what debug mode is for
        with pytest.raises(PlanWriteError) as err:
            loud.step(batch, inputs)
    assert err.value.field == "paged.kv_lens"
