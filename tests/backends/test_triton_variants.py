"""Metadata kernels compile once per run, whatever the batch.

A Triton kernel specialises on an argument's value (1, divisible by 16) and on a
pointer's 16-byte alignment unless told not to. In an eager extend plan the sizes
change every batch and a view into the staging buffer can start 8 bytes off, so
each new combination compiled a variant mid-serving: 0.15-0.2 s of stall in the
H200's first prefills (docs/benchmarks.md). These tests pin what is asked of Triton.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from backends.common import ragged_triton
from backends.common import triton_kernels as tk
from backends.common.triton_kernels import LazyKernel, unspecialised

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton
ALIGNMENT_KNOB = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def test_unspecialised_names_sizes_and_pointers():
    keywords = unspecialised(["n", "reqs"], ["out_ptr"])
    assert keywords["do_not_specialize"] == ["n", "reqs"]
    if ALIGNMENT_KNOB:
        assert keywords["do_not_specialize_on_alignment"] == ["out_ptr"]
    else:
        assert "do_not_specialize_on_alignment" not in keywords


def test_lazy_kernel_asks_for_no_size_or_alignment_variants(monkeypatch):
    seen = {}

    def fake_jit(fn, **keywords):
        seen.update(keywords)
        return {(1,): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    monkeypatch.setattr(tk, "unspecialised", unspecialised)  # the real one, on the fake jit

    def kernel(out_ptr, in_ptr, n, stride, BLOCK):  # noqa: N803 (Triton constexpr style)
        pass

    LazyKernel(kernel)[(1,)]
    assert seen["do_not_specialize"] == ["n", "stride"]
    if "do_not_specialize_on_alignment" in seen:
        assert seen["do_not_specialize_on_alignment"] == ["out_ptr", "in_ptr"]


def test_forward_kernels_keep_pointer_alignment(monkeypatch):
    """The sparse MLA and top-k gather wide rows: their pointers stay specialised on 16-byte
    alignment (vector loads), their sizes do not."""
    from backends.nsa import sparse_mla_triton, topk_triton

    seen = []

    def fake_jit(fn, **keywords):
        seen.append(keywords)
        return {(1,): lambda *a, **k: None}

    monkeypatch.setattr(tk.triton, "jit", fake_jit)
    for lazy in (sparse_mla_triton._attend, sparse_mla_triton._combine, topk_triton._row_topk):
        fresh = LazyKernel(lazy._fn, aligned=lazy._aligned)  # not the module's cached variants
        fresh[(1,)]
        assert lazy._aligned
        assert seen[-1].get("do_not_specialize_on_alignment", []) == []
        assert seen[-1]["do_not_specialize"] and not any(
            name.endswith("_ptr") for name in seen[-1]["do_not_specialize"]
        )


def test_ragged_launches_use_one_block_size(monkeypatch):
    """A 1-token and a 3000-token launch must hit the same compiled variant."""
    blocks = []
    original = LazyKernel.__getitem__

    def spy(self, grid):
        launch = original(self, grid)

        def call(*args, **kwargs):
            blocks.append(kwargs["BLOCK"])
            return launch(*args, **kwargs)

        return call

    monkeypatch.setattr(LazyKernel, "__getitem__", spy)
    for tokens in (1, 70, 3000):
        qo = torch.tensor([0, tokens], dtype=torch.int32)
        out = torch.empty(tokens, dtype=torch.int32)
        ragged_triton.token_request(out, qo, 0)
        slots = torch.empty(tokens, dtype=torch.int32)
        table = torch.arange(4096, dtype=torch.int32).view(1, 4096)
        ragged_triton.kv_gather_slots(slots, table, torch.zeros(1, dtype=torch.int32), qo)
    assert len(blocks) == 6 and len(set(blocks)) == 1
