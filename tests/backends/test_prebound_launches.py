"""Prebound launches pick the compiled variant Triton would, or let Triton launch.

A fake JIT kernel stands in for Triton here (compiling needs a GPU; the GPU suite runs
the real kernels prebound against their torch references): it records which launches
went through its launcher and which called a compiled variant directly, with what.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from backends.common import lazy_kernel
from backends.common.lazy_kernel import LazyKernel, PreboundLaunches
from tests.support.faults import runtime_warnings


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setattr(lazy_kernel, "_current_device", lambda: 0)


@dataclasses.dataclass
class Param:
    name: str
    is_constexpr: bool = False
    do_not_specialize: bool = True
    do_not_specialize_on_alignment: bool = True


class Compiled:
    def __init__(self, jit, key):
        self.jit, self.key = jit, key

    def __getitem__(self, grid):
        def run(*args):
            if self.jit.broken:
                raise TypeError("launcher signature changed")
            self.jit.direct.append((self.key, grid, args))

        return run


class FakeJit:
    """Compiles one variant per (dtypes, int widths, constexprs), as an unspecialised kernel."""

    def __init__(self, params):
        self.params = params
        self.through_triton, self.direct, self.variants = [], [], {}
        self.broken = False

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            full = args + tuple(kwargs.get(p.name, 0) for p in self.params[len(args) :])
            key = tuple(
                v
                if p.is_constexpr
                else (
                    v.dtype
                    if isinstance(v, torch.Tensor)
                    else repr(v)
                    if isinstance(v, list)
                    else abs(v) < 2**31
                )
                for p, v in zip(self.params, full)
            )
            self.through_triton.append((grid, full))
            return self.variants.setdefault(key, Compiled(self, key))

        return run


def kernel_with(*extra: Param) -> FakeJit:
    return FakeJit([Param("out_ptr"), Param("n"), *extra, Param("BLOCK", is_constexpr=True)])


def launch(launches, grid, *args, **kwargs):
    return launches.launch(grid, args, kwargs)


def test_the_first_launch_of_a_variant_goes_through_triton_and_later_ones_are_prebound():
    jit = kernel_with()
    launches = PreboundLaunches(jit)
    out = torch.zeros(4, dtype=torch.int32)
    assert launches.usable
    launch(launches, (2,), out, 7, BLOCK=64)
    launch(launches, (3, 2), out, 9, BLOCK=64)
    assert len(jit.through_triton) == 1 and launches.prebound == 1
    (key, grid, args) = jit.direct[0]
    assert grid == (3, 2, 1) and args == (out, 9, 64)  # constexprs last, in signature order


@pytest.mark.parametrize(
    "change",
    [
        {"n": 2**31},  # an i64 argument: another variant
        {"BLOCK": 128},  # another constexpr value
        {"out": torch.zeros(4, dtype=torch.int64)},  # another dtype
    ],
)
def test_what_selects_a_variant_gets_its_own_triton_launch(change):
    jit = kernel_with()
    launches = PreboundLaunches(jit)
    base = {"out": torch.zeros(4, dtype=torch.int32), "n": 5, "BLOCK": 64}
    launch(launches, (1,), base["out"], base["n"], BLOCK=base["BLOCK"])
    other = {**base, **change}
    launch(launches, (1,), other["out"], other["n"], BLOCK=other["BLOCK"])
    assert len(jit.through_triton) == 2 and launches.prebound == 0
    launch(launches, (1,), other["out"], other["n"], BLOCK=other["BLOCK"])
    assert launches.prebound == 1
    assert jit.direct[-1][0] == list(jit.variants)[1]  # the changed launch's own variant
    assert jit.direct[-1][2] == (other["out"], other["n"], other["BLOCK"])


def test_a_kernel_with_a_specialised_argument_keeps_tritons_launcher():
    both = Param("stride", do_not_specialize=False, do_not_specialize_on_alignment=False)
    assert not PreboundLaunches(kernel_with(both)).usable
    assert not PreboundLaunches(object()).usable  # a Triton that does not describe its params


def test_a_value_where_triton_would_specialise_it_goes_through_triton_every_time():
    # as LazyKernel asks: pointers free of alignment only, sizes free of value only
    jit = FakeJit(
        [
            Param("out_ptr", do_not_specialize=False),
            Param("n", do_not_specialize_on_alignment=False),
            Param("BLOCK", is_constexpr=True),
        ]
    )
    launches = PreboundLaunches(jit)
    out = torch.zeros(2, dtype=torch.int32)
    for _ in range(3):
        launch(launches, (1,), out, 16, BLOCK=8)  # as declared: prebound after the first
        launch(launches, (1,), 16, out, BLOCK=8)  # an int where only alignment is free
    assert launches.usable and launches.prebound == 2 and len(jit.through_triton) == 4


def test_floats_share_one_variant_and_variants_kept_are_bounded():
    jit = kernel_with(Param("scale"))
    launches = PreboundLaunches(jit)
    out = torch.zeros(2, dtype=torch.int32)
    for scale in (0.5, 0.25, 2.0):
        launch(launches, (1,), out, 3, scale, BLOCK=8)
    assert launches.prebound == 2
    for block in range(100):  # more constexpr values than are kept: the rest through Triton
        launch(launches, (1,), out, 3, 1.0, BLOCK=block)
    assert len(launches._compiled) == lazy_kernel._VARIANTS_KEPT


def test_keywords_that_do_not_fill_the_tail_and_unkeyed_kinds_go_through_triton():
    jit = kernel_with(Param("scale"))
    launches = PreboundLaunches(jit)
    out = torch.zeros(2, dtype=torch.int32)
    for _ in range(2):
        launch(launches, (1,), out, 3, scale=1, BLOCK=8)  # fills the tail: prebound later
        launch(launches, (1,), out, n=3, scale=1, BLOCK=8)  # so does this
        launch(launches, (1,), out, 3, BLOCK=8)  # a default left to Triton
        launch(launches, (1,), out, 3, [1], BLOCK=8)  # a list: not a kind it keys on
    assert launches.prebound == 3 and len(jit.through_triton) == 5


def test_a_compiled_kernel_that_refuses_the_call_turns_prebinding_off_once():
    jit = kernel_with()
    launches = PreboundLaunches(jit)
    out = torch.zeros(2, dtype=torch.int32)
    launch(launches, (1,), out, 3, BLOCK=8)
    jit.broken = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch(launches, (1,), out, 3, BLOCK=8)
        launch(launches, (1,), out, 3, BLOCK=8)
    assert not launches.usable and launches.prebound == 0
    assert len(jit.through_triton) == 3  # the refused launch was redone by Triton
    said = [m for m in runtime_warnings(caught) if "not callable directly" in m]
    assert len(said) == 1


def test_the_lazy_kernel_prebinds_compiled_unaligned_kernels_unless_switched_off(monkeypatch):
    def body(out_ptr, n, BLOCK):  # noqa: N803 (Triton constexpr style)
        pass

    made = []

    def fake_jit(fn, **keywords):
        made.append(kernel_with())
        return made[-1]

    monkeypatch.setattr(lazy_kernel.triton, "jit", fake_jit)
    monkeypatch.setattr(lazy_kernel, "_interpreting", lambda: False)
    kernel, aligned = LazyKernel(body), LazyKernel(body, aligned=True)
    out = torch.zeros(2, dtype=torch.int32)
    for _ in range(3):
        kernel[(1,)](out, 4, BLOCK=8)
        aligned[(1,)](out, 4, BLOCK=8)
    assert kernel.launches.prebound == 2 and aligned.launches is None
    assert len(made[1].through_triton) == 3
    monkeypatch.setenv("FORWARD_PLANNER_PREBOUND", "0")
    kernel[(1,)](out, 4, BLOCK=8)
    assert kernel.launches.prebound == 2 and len(made[0].through_triton) == 2
