"""The NSA FlashInfer companion plan on the CPU: tables, host op, memo, the layer's path.

FlashInfer itself is replaced by a fake that keeps its documented contract for the MLA
wrapper (buffers bound at construction in graph mode, ``plan`` reading host arrays,
``run`` reading only the index buffer it was bound to and the lengths it was planned
with); the H200 run confirms the real kernel (tests/gpu/test_nsa_flashinfer_gpu.py).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.nsa.attention import sparse_mla_decode
from backends.nsa_flashinfer import SPARSE_POOL, NSAFlashInferPlan, sparse_mla_flashinfer
from backends.nsa_flashinfer.slots import row_lengths
from planner import ConfigError, ForwardMode, PlanError, PlanSet, SchemaError
from tests.support.batches import random_batch
from tests.support.fake_flashinfer import install_fake_flashinfer
from tests.support.planners import PlannerSetup, replay_smallest

TOPK = 16
SCALE = 0.25
HEADS, LATENT, ROPE = 2, 512, 64
OPTIONS = {
    "nsa": {"topk": TOPK, "mla_heads": HEADS, "mla_kernel": "torch"},
    "nsa_flashinfer": {"sparse_topk": TOPK, "sparse_heads": HEADS, "sparse_sm_scale": SCALE},
}
SETUP = PlannerSetup(("nsa", "nsa_flashinfer"), 4, 192, 64, pool=8, options=OPTIONS)
SIZES = [1, 2, 4]


@pytest.fixture(autouse=True)
def _fresh_pool():
    SPARSE_POOL.release()
    yield
    SPARSE_POOL.release()


def layer_slots(plan: NSAFlashInferPlan, gen: torch.Generator, num_slots: int) -> torch.Tensor:
    """What the length-aware indexer hands the layer: kv_len[r] distinct valid slots, -1 after."""
    rows = plan.kv_len.shape[0]
    out = torch.full((rows, TOPK), -1, dtype=torch.int32)
    for r, n in enumerate(plan.kv_len.tolist()):
        out[r, :n] = torch.randperm(num_slots - 1, generator=gen)[:n].to(torch.int32) + 1
    return out


def inputs(rows: int, gen: torch.Generator, num_slots: int = 300):
    q = torch.randn(rows, HEADS, LATENT, generator=gen, dtype=torch.float64) * 0.1
    qr = torch.randn(rows, HEADS, ROPE, generator=gen, dtype=torch.float64)
    kv = torch.randn(num_slots, LATENT + ROPE, generator=gen, dtype=torch.float64)
    return q, qr, kv


def check_against_reference(plan: NSAFlashInferPlan, gen: torch.Generator) -> None:
    rows = plan.kv_len.shape[0]
    q, qr, kv = inputs(rows, gen)
    slots = layer_slots(plan, gen, kv.shape[0])
    got = sparse_mla_flashinfer(plan, q, qr, kv, slots, SCALE)
    torch.testing.assert_close(got, sparse_mla_decode(q, qr, kv, slots, SCALE), rtol=0, atol=0)


@given(
    lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    pad=st.integers(0, 3),
    next_n=st.integers(1, 4),
    topk=st.sampled_from([1, 7, 2048]),
)
@settings(max_examples=60, deadline=None)
def test_host_row_lengths_are_the_planners_clamped_causal_lengths(lens, pad, next_n, topk):
    seq = np.array([max(n, next_n) for n in lens], dtype=np.int32)
    reqs = len(seq) + pad
    padded = np.concatenate([seq, np.full(pad, next_n, dtype=np.int32)])
    back = np.arange(next_n - 1, -1, -1)
    want = np.minimum((padded[:, None] - back).reshape(-1), topk)
    assert np.array_equal(row_lengths(seq, reqs, next_n, topk), want)


@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_captured_plans_share_nsa_lengths_and_replay_equals_the_reference(next_n):
    planner = SETUP.planner(next_n=next_n)
    mode = ForwardMode.TARGET_VERIFY if next_n > 1 else ForwardMode.DECODE
    captured = {bs: planner.capture(bs, mode, req_to_token=SETUP.table) for bs in SIZES}
    rng, gen = random.Random(next_n), torch.Generator().manual_seed(next_n)
    for _ in range(6):
        batch = SETUP.batch(rng, bs=rng.randint(1, max(SIZES)), next_n=next_n, mode=mode)
        bs, plans = replay_smallest(planner, batch, SIZES)  # the in-graph ops run at record
        assert plans is captured[bs]
        fi, nsa = plans["nsa_flashinfer"], plans["nsa"]
        rows = bs * next_n
        assert fi.kv_len.data_ptr() == nsa.topk_lens.data_ptr()  # computed once, read by both
        assert torch.equal(fi.kv_indptr, torch.arange(rows + 1, dtype=torch.int32) * TOPK)
        lens = fi.kv_len.tolist()
        real = batch.seq_lens_cpu.shape[0] * next_n
        assert fi.plan_info.tolist() == [rows, real, sum(lens), max(lens)]
        check_against_reference(fi, gen)


def test_eager_plan_matches_and_debug_mode_checks_replays():
    planner = SETUP.planner(debug=True)
    planner.capture(4, req_to_token=SETUP.table)
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = SETUP.batch(rng, bs=rng.randint(1, 4))
        check_against_reference(planner.plan(batch)["nsa_flashinfer"], gen)
        check_against_reference(replay_smallest(planner, batch, [4])[1]["nsa_flashinfer"], gen)


def test_plan_is_skipped_while_the_lengths_repeat():
    planner = SETUP.planner()
    planner.capture(2, req_to_token=SETUP.table)
    rng = random.Random(2)
    batch = SETUP.batch(rng, bs=2)
    slot = planner.replay(batch, 2)["nsa_flashinfer"].wrapper.slot
    plans, skipped = slot.plans, slot.skipped
    planner.replay(batch, 2)
    assert (slot.plans, slot.skipped) == (plans, skipped + 1)
    for _ in range(6):  # lengths past topk read the same top-k lengths: the memo holds
        moved = SETUP.batch(rng, bs=2)
        same = np.array_equal(
            row_lengths(moved.seq_lens_cpu.numpy(), 2, 1, TOPK),
            row_lengths(batch.seq_lens_cpu.numpy(), 2, 1, TOPK),
        )
        before = slot.plans
        planner.replay(moved, 2)
        assert slot.plans == before + (0 if same else 1)
        batch = moved
    short = random_batch(rng, SETUP.table, max_batch=2, max_context=TOPK - 1, bs=2)
    assert not np.array_equal(  # below topk: this batch's own lengths
        row_lengths(short.seq_lens_cpu.numpy(), 2, 1, TOPK),
        row_lengths(batch.seq_lens_cpu.numpy(), 2, 1, TOPK),
    )
    before = slot.plans
    planner.replay(short, 2)
    assert slot.plans == before + 1


class _FakeSparseMLA:
    """FlashInfer's MLA wrapper, as far as the sparse plan uses it."""

    made: list[_FakeSparseMLA] = []

    def __init__(self, workspace, use_cuda_graph=False, backend="auto", **buffers):
        self.graph = use_cuda_graph
        self.buffers = buffers
        self.calls = []
        _FakeSparseMLA.made.append(self)

    def plan(self, qo, indptr, indices, lens, heads, latent, rope, page, causal, scale, qd, kd):
        assert all(t.device.type == "cpu" for t in (qo, indptr, lens))  # host arrays only
        if self.graph:  # FlashInfer copies what it is given onto its bound buffer
            self.buffers["kv_indices"][: len(indices)].copy_(indices)
        self.indices = self.buffers["kv_indices"] if self.graph else indices
        self.calls.append(
            dict(qo=qo.clone(), indptr=indptr.clone(), lens=lens.clone(), page=page,
                 causal=causal, scale=scale, heads=heads)
        )  # fmt: skip

    def run(self, q_nope, q_pe, ckv, kpe, out):
        c = self.calls[-1]
        kv = torch.cat([ckv[:, 0], kpe[:, 0]], dim=-1)
        slots = torch.full((q_nope.shape[0], TOPK), -1, dtype=torch.int32)
        for r in range(q_nope.shape[0]):
            n, start = int(c["lens"][r]), int(c["indptr"][r])
            slots[r, :n] = self.indices[start : start + n]
        out.copy_(sparse_mla_decode(q_nope, q_pe, kv, slots, c["scale"]))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    _FakeSparseMLA.made.clear()
    install_fake_flashinfer(monkeypatch, BatchMLAPagedAttentionWrapper=_FakeSparseMLA)


def test_wrappers_are_planned_with_the_static_layout_and_run_the_layers_slots(fake_flashinfer):
    planner = SETUP.planner(providers={"nsa_flashinfer_plan": "flashinfer"})
    captured = {bs: planner.capture(bs, req_to_token=SETUP.table) for bs in SIZES}
    assert len([w for w in _FakeSparseMLA.made if w.graph]) == len(SIZES)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    for _ in range(5):
        batch = SETUP.batch(rng, bs=rng.randint(1, max(SIZES)))
        bs, plans = replay_smallest(planner, batch, SIZES)
        fi = plans["nsa_flashinfer"]
        assert fi is captured[bs]["nsa_flashinfer"]
        slot = fi.wrapper.slot
        assert slot.wrapper.buffers["kv_indices"] is slot.kv_indices
        call = slot.wrapper.calls[-1]
        assert torch.equal(call["qo"], torch.arange(bs + 1, dtype=torch.int32))
        assert torch.equal(call["indptr"], torch.arange(bs + 1, dtype=torch.int32) * TOPK)
        assert call["lens"].tolist() == fi.kv_len.tolist()
        assert (call["page"], call["causal"], call["scale"], call["heads"]) == (1, False, SCALE, 2)
        check_against_reference(fi, gen)
    assert len([w for w in _FakeSparseMLA.made if w.graph]) == len(SIZES)  # none made at replay


def test_a_superseded_eager_plan_is_refused(fake_flashinfer):
    planner = SETUP.planner(providers={"nsa_flashinfer_plan": "flashinfer"})
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    first = planner.plan(SETUP.batch(rng, bs=3))["nsa_flashinfer"]
    check_against_reference(first, gen)
    second = None
    while second is None or first.wrapper.current:
        second = planner.plan(SETUP.batch(rng, bs=2))["nsa_flashinfer"]
    assert len(_FakeSparseMLA.made) == 1  # one eager wrapper, grown to the largest batch
    q, qr, kv = inputs(3, gen)
    with pytest.raises(PlanError, match="newer eager plan"):
        sparse_mla_flashinfer(first, q, qr, kv, layer_slots(first, gen, kv.shape[0]), SCALE)
    check_against_reference(second, gen)


def test_bad_layer_inputs_name_the_field():
    planner = SETUP.planner()
    fi = planner.plan(SETUP.batch(random.Random(5), bs=2))["nsa_flashinfer"]
    q, qr, kv = inputs(2, torch.Generator().manual_seed(5))
    slots = torch.zeros(2, TOPK, dtype=torch.int32)
    with pytest.raises(PlanError) as e:
        sparse_mla_flashinfer(fi, q, qr, kv, slots, 0.5)
    assert e.value.field == "softmax_scale"
    with pytest.raises(PlanError) as e:
        sparse_mla_flashinfer(fi, q, qr, kv, slots[:, :4], SCALE)
    assert e.value.field == "topk_slots"
    with pytest.raises(PlanError) as e:
        sparse_mla_flashinfer(fi, q[:1], qr[:1], kv, slots[:1], SCALE)
    assert e.value.field == "q_nope_abs"
    with pytest.raises(PlanError) as e:
        sparse_mla_flashinfer(fi, q, qr, kv[:, :LATENT], slots, SCALE)
    assert e.value.field == "kv_cache"


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("sparse_latent", 256, "nsa_flashinfer.sparse_latent"),
        ("sparse_backend", "cutlass", "nsa_flashinfer.sparse_backend"),
        ("sparse_sm_scale", 0.0, "nsa_flashinfer.sparse_sm_scale"),
        ("sparse_topk", 0, "nsa_flashinfer.sparse_topk"),
        ("sparse_q_dtype", "float32", "nsa_flashinfer.sparse_q_dtype"),
    ],
)
def test_bad_settings_are_refused_when_the_planner_is_built(option, value, field):
    options = {**OPTIONS, "nsa_flashinfer": {**OPTIONS["nsa_flashinfer"], option: value}}
    with pytest.raises(SchemaError) as e:
        SETUP.planner(options=options)
    assert e.value.field == field


def test_a_plan_set_without_the_companion_gives_none_to_get_and_an_error_to_index():
    plans = SETUP.planner().plan(SETUP.batch(random.Random(6), bs=2))
    assert plans.get("nsa_flashinfer") is plans["nsa_flashinfer"]
    alone = PlanSet({"nsa": plans["nsa"]}, "eager", ForwardMode.DECODE, 2, 2)
    assert alone.get("nsa_flashinfer") is None  # extend batches: layers keep nsa's kernel
    with pytest.raises(SchemaError, match="no plan for backend"):
        alone["nsa_flashinfer"]


def test_the_engine_refuses_flashinfer_sparse_mla_on_a_gpu_without_flashinfer(monkeypatch):
    from dsv32_engine.serving import plan_setup

    class Model:  # what plan_schemas reads of a model
        PLANS: ClassVar[dict] = {}
        OPTIONAL_PLANS: ClassVar[dict] = {"nsa_flashinfer": (NSAFlashInferPlan,)}
        config = SimpleNamespace(index_topk=TOPK, softmax_scale=SCALE)
        attention_heads = HEADS
        dtype = torch.bfloat16

    model = Model()
    monkeypatch.setattr(plan_setup, "flashinfer_importable", lambda: False)
    with pytest.raises(ConfigError) as e:
        plan_setup.plan_schemas("flashinfer", "0.1.0", model, torch.device("cuda"))
    assert e.value.field == "planner.mla_kernel"
    schemas, options, _ = plan_setup.plan_schemas("flashinfer", "0.1.0", model, torch.device("cpu"))
    assert NSAFlashInferPlan in schemas and options["nsa"]["mla_kernel"] == "auto"
    assert options["nsa_flashinfer"]["sparse_heads"] == HEADS
