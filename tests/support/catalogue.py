"""The bad-input catalogue's case types and the checks every case goes through.

A case is data: its kind (the row of ``docs/reliability.md``), a category, how to make the
input, the ``PlanError`` class it must raise, the field that error names (``err.field``
and the message), the limit the message states, and where it is refused: the code, and
the phases. A bad batch runs in every phase it applies to (``plan``, and ``replay`` after
a capture); any other case is one call. Inputs that are not refused today are
``Finding``s, strict xfails until fixed. Both catalogues build planners of the two setups
at the top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from graphs.graph import Graph, new_graph
from planner import PlanError, Planner, PlanSet
from planner.program import Step
from tests.support.planners import PlannerSetup

PAGED_16 = PlannerSetup(
    ("paged",), max_batch=4, max_context=128, page_size=16, limits={"kv_slots": 10**5}
)
"""The door checks' planner: paged over 16-token pages, slots below 10**5."""
KV_SLOTS = 20 * 256
NSA_PAGED_64 = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"kv_slots": KV_SLOTS}
)
"""The catalogue's planner: NSA and paged over 64-token pages; every table slot is below
``KV_SLOTS``."""


@dataclass(frozen=True)
class Case:
    """One kind of bad input: how to make it, and how and where it must be refused."""

    kind: str
    """Its row in docs/reliability.md."""
    category: str
    make: Callable[[], Any]
    """How to make it: the bad batch of a batch case, or else the call that must be refused."""
    error: type[PlanError]
    field: str
    limit: str | None = None
    where: str = ""
    """The code that refuses it."""
    phases: tuple[str, ...] = ("call",)
    """``call`` (``make()`` is refused), or ``plan`` / ``replay`` of the batch ``make()``
    returns, by a planner of ``setup``; replay captures ``captured`` requests first and
    replays at ``replay_bs``."""
    setup: PlannerSetup | None = None
    planner: Mapping[str, Any] = field(default_factory=dict)
    """``PlannerSetup.planner`` keywords: other backends, limits."""
    captured: int = 4
    replay_bs: int | float = 4
    """A float tests the size check itself."""
    skip: Mapping[str, str] = field(default_factory=dict)
    """Phases listed but not run, with the reason (a check that phase does not make)."""
    at_read: bool = False
    """A value the device check refuses (``planner/device_checks.py``): ``plan()`` raises at
    once; ``replay()`` takes it, the graph runs, and ``Planner.read`` raises."""
    own_table: bool = False
    """Replay captures over the batch's own token table (the table changed in place since
    the capture; the capture's dummy batch reads only its null row 0)."""


def record_launches(monkeypatch, *, run: bool = False) -> list[str]:
    """From now on, every metadata op a planner launches is recorded here instead of run
    (``run``: recorded and run)."""
    launched: list[str] = []
    real = Step.run

    def launch(step, *args, **kwargs):
        launched.append(step.key)
        return real(step, *args, **kwargs) if run else None

    monkeypatch.setattr(Step, "run", launch)
    return launched


def refuse(case: Case, phase: str, monkeypatch, device: str | None = None) -> list[str]:
    """Check that ``case`` is refused in ``phase``; the ops that launched on the host before
    it was (recorded from the moment the input is handed over: after any capture).

    A replay of an ``at_read`` case is not refused by ``replay()``: its graph (captured
    after the planner's capture: an emulated one, on ``device="cuda"`` a CUDA graph, whose
    token table moves there) then runs on the refused batch, every source field of the
    plans must hold its pad only (no KV slot but the null slot is written, no request but
    the null request read), and ``Planner.read`` raises before it returns the step's
    outputs."""
    if phase == "call":
        launched = record_launches(monkeypatch)
        expect_refused(case, case.make)
        return launched
    kwargs = dict(case.planner)
    if device is not None:
        kwargs["device"] = device
    planner = case.setup.planner(kwargs.pop("backends", None), **kwargs)
    batch = case.make()
    if device is not None:
        batch = dataclasses.replace(batch, req_to_token=batch.req_to_token.to(device))
    graph = None
    if phase == "replay":
        own = case.own_table or device is not None  # the setup's table, moved once
        table = batch.req_to_token if own else case.setup.table
        planner.capture(case.captured, req_to_token=table)
        if case.at_read:
            graph = _graph_of(planner, lambda: planner.record(case.replay_bs, batch.plans_as))
    launched = record_launches(monkeypatch, run=graph is not None)
    if phase == "plan":
        expect_refused(case, lambda: planner.plan(batch))
    elif graph is None:
        expect_refused(case, lambda: planner.replay(batch, case.replay_bs))
    else:
        plans = planner.replay(batch, case.replay_bs)  # checked on the device, in the graph
        on_host = list(launched)
        graph.replay()
        assert not_pads(planner, plans) == {}, "a refused batch reached a source field"
        expect_refused(case, lambda: planner.read(torch.arange(batch.bs, device=planner.device)))
        return on_host
    return launched


def _graph_of(planner: Planner, record: Callable[[], None]) -> Graph:
    """``record`` captured in a graph as a graph runner captures it: an emulated one, or on
    CUDA after the providers' warm-up and one eager run, on a stream of its own."""
    if planner.device.type != "cuda":
        graph = new_graph("emulated")
    else:
        planner.warm_up()
        record()
        torch.cuda.synchronize(planner.device)
        graph = new_graph("cuda", torch.cuda.Stream(planner.device))
    graph.capture(lambda: record() or [])
    return graph


def not_pads(planner: Planner, plans: PlanSet) -> dict[str, list[int]]:
    """``backend.field`` -> values of every source field (a schema's ``source=``: what the
    device check writes) holding anything but its pad: ``{}`` for plans made from pads
    only, which write the null KV slot 0 alone and read the null request 0 alone."""
    pads = planner.program(plans.mode.plans_as).pads
    out = {}
    for backend, plan in plans.items():
        for name, spec in type(plan).tensor_specs.items():
            tensor = getattr(plan, name)
            if spec.source is not None and not bool((tensor == pads[(backend, name)]).all()):
                out[f"{backend}.{name}"] = tensor.flatten().tolist()
    return out


def expect_refused(case: Case, run: Callable[[], object]) -> PlanError:
    """``run()`` raises ``case.error`` naming ``case.field`` (in ``err.field`` and the
    message) and stating ``case.limit``."""
    with pytest.raises(PlanError) as info:
        run()
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__}: {err}"
    assert err.field == case.field, str(err)
    assert case.field in str(err)
    if case.limit is not None:
        assert case.limit in str(err), str(err)
    return err


def case_params(cases: Sequence[Case]) -> list:
    """One ``(case, phase)`` param per phase of each case, id ``phase-kind``."""
    return [
        pytest.param(
            case,
            phase,
            id=f"{phase}-{case.kind}",
            marks=[pytest.mark.skip(reason=case.skip[phase])] if phase in case.skip else [],
        )
        for case in cases
        for phase in case.phases
    ]


@dataclass(frozen=True)
class Finding:
    """An input not refused today (or refused without a ``PlanError``): see docs/reliability.md."""

    kind: str
    reason: str
    run: Callable[[Path], object]
    fields: tuple[str, ...]
    """``err.field`` values a fix may reasonably choose."""
    fixed: bool = False
    """Refused now: stays as a regression test; open findings are strict xfails."""


def finding_params(findings: Sequence[Finding]) -> list:
    """Fixed findings as plain params, open ones as ``xfail(strict=True)``, id the kind."""
    return [
        pytest.param(
            f,
            id=f.kind,
            marks=[] if f.fixed else [pytest.mark.xfail(strict=True, reason=f.reason)],
        )
        for f in findings
    ]


def expect_finding_refused(finding: Finding, tmp: Path) -> None:
    with pytest.raises(PlanError) as info:
        finding.run(tmp)
    assert info.value.field in finding.fields, str(info.value)
