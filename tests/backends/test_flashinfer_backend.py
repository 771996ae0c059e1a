"""FlashInfer backends on the CPU: metadata ops, the three phases, the host op, the references.

Without CUDA the Triton kernels run under the interpreter, switched on before
``triton.language`` is first imported (see ``backends.common.triton_kernels``).
FlashInfer itself is replaced by a small fake that keeps its documented
contract (buffers bound at construction in graph mode, ``plan`` reading host
arrays, ``run`` reading only what it was bound to and planned with), which
checks the wrapper plumbing that the GPU run then confirms with the real kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.flashinfer import (  # noqa: E402
    flashinfer_decode_attention,
    flashinfer_mla_attention,
    reference_decode_attention,
    reference_mla_attention,
    release_wrappers,
)
from backends.flashinfer import kernels as tri  # noqa: E402
from backends.flashinfer import ops as fi_ops  # noqa: E402
from backends.flashinfer import reference as ref  # noqa: E402
from planner import (  # noqa: E402
    ForwardMode,
    Limits,
    PlanError,
    Planner,
    ProviderError,
    SchemaError,
)
from tests.support import REPO  # noqa: E402
from tests.support.batches import mode_for, modes_for  # noqa: E402
from tests.support.fake_flashinfer import install_fake_flashinfer  # noqa: E402
from tests.support.kernels import DEVICE, I32, garbage, ints  # noqa: E402
from tests.support.planners import (  # noqa: E402
    PlannerSetup,
    capture_all,
    pointers,
    replay_smallest,
)

MAX_BATCH, MAX_CTX = 8, 150
SIZES = [1, 2, 4, MAX_BATCH]
MLA_OPTIONS = {"num_heads": 2}
DECODE_OPTIONS = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64}
SETUPS = {
    ps: PlannerSetup(
        ("flashinfer_decode", "flashinfer_mla"),
        MAX_BATCH,
        MAX_CTX,
        ps,
        pool=24,
        seed=ps,
        options={"flashinfer_decode": DECODE_OPTIONS, "flashinfer_mla": MLA_OPTIONS},
    )
    for ps in (1, 16, 64)
}
"""One setup per page size; a planner gets the options of the backends it plans."""
TABLES = {ps: setup.table for ps, setup in SETUPS.items()}

IMPLS = [
    pytest.param(ref, id="torch"),
    pytest.param(tri, id="triton", marks=pytest.mark.triton(device=DEVICE)),
]


@pytest.fixture(autouse=True)
def _fresh_pool():
    release_wrappers()
    yield
    release_wrappers()


# --- ops: hand-checked, and Triton equal to the reference ---------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_per_request_page_tables(impl):
    out = garbage(5)
    impl.pages_per_request(out, ints([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 1, 2, 2, 3]
    impl.last_page_len(out, ints([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 16, 1, 16, 1]
    impl.last_page_len(out, ints([1, 2, 3, 4, 5]), 1)
    assert out.tolist() == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_kv_indices_example(impl):
    # page_size 4; request 0 (pool row 2) has 6 tokens = 2 pages, request 1 (row 1) 1 token.
    table = ints([[0] * 8, [40, 41, 42, 43, 44, 45, 46, 47], [12, 13, 14, 15, 28, 29, 30, 31]])
    indptr = ints([0, 2, 3])
    out = garbage(2 * 3)  # capacity: 2 requests x 3 pages
    impl.paged_kv_indices(out, table, ints([2, 1], torch.int64), indptr, 4)
    assert out.tolist() == [3, 7, 10, 0, 0, 0]
    unit = garbage(2 * 4)
    impl.paged_kv_indices(unit, table[:, :4], ints([1, 2]), ints([0, 3, 4]), 1)
    assert unit.tolist() == [40, 41, 42, 12, 0, 0, 0, 0]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    reqs=st.integers(1, 9),
    page_size=st.sampled_from([1, 2, 16, 64]),
    spare=st.integers(0, 3),
)
@pytest.mark.triton(device=DEVICE)
def test_triton_kv_indices_equal_reference(seed, reqs, page_size, spare):
    g = torch.Generator().manual_seed(seed)
    ctx = int(torch.randint(1, 300, (1,), generator=g))
    lens = torch.randint(1, ctx + 1, (reqs,), generator=g, dtype=I32)
    counts = (lens + page_size - 1) // page_size
    width = int(counts.max()) + spare
    indptr = torch.zeros(reqs + 1, dtype=I32)
    indptr[1:] = counts.cumsum(0)
    table = torch.randint(0, 1 << 20, (reqs + 3, ctx), generator=g, dtype=I32)
    pool = torch.randint(0, reqs + 3, (reqs,), generator=g, dtype=torch.int64)
    args = (table.to(DEVICE), pool.to(DEVICE), indptr.to(DEVICE), page_size)
    expected, actual = garbage(reqs * width), garbage(reqs * width)
    ref.paged_kv_indices(expected, *args)
    tri.paged_kv_indices(actual, *args)
    assert torch.equal(expected.cpu(), actual.cpu())
    total = int(indptr[-1])
    assert not expected[total:].any()
    first = (table[pool[0], 0] // page_size).item()
    assert expected[0].item() == first


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 3, 64]))
@pytest.mark.triton(device=DEVICE)
def test_triton_page_split_equals_reference(seed, page_size):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(
        -5, 1 << 20, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g, dtype=I32
    )
    for name in ("pages_per_request", "last_page_len"):
        expected, actual = garbage(lens.shape[0]), garbage(lens.shape[0])
        getattr(ref, name)(expected, lens.to(DEVICE), page_size)
        getattr(tri, name)(actual, lens.to(DEVICE), page_size)
        assert torch.equal(expected.cpu(), actual.cpu()), name


# --- the three phases ------------------------------------------------------------------


def _check_host_args(plans, real: int) -> None:
    """What the host op recorded for FlashInfer equals the device plan fields, padding included."""
    for backend in plans:
        plan = plans[backend]
        slot = plan.wrapper.slot
        assert slot is not None, backend
        args = slot.args
        assert torch.equal(args.kv_indptr, plan.kv_indptr.cpu())
        assert torch.equal(args.qo_indptr, plan.qo_indptr.cpu())
        assert torch.equal(args.kv_lens, plan.seq_lens.cpu())
        if backend == "flashinfer_decode":
            assert torch.equal(args.last_page_len, plan.kv_last_page_len.cpu())
        else:
            assert torch.equal(args.kv_lens, plan.kv_len_arr.cpu())
        lens = plan.seq_lens.cpu().to(torch.int64)
        assert plan.plan_info.tolist() == [
            len(lens),
            int(plan.kv_indptr[-1]),
            int(lens.sum()),
            int(lens.max()),
        ]
        assert (plan.seq_lens[real:] == plan.next_n).all()


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 64]), next_n=st.sampled_from([1, 2])
)
def test_replay_equals_eager_for_random_sequences(seed, page_size, next_n):
    rng = random.Random(seed)
    setup = SETUPS[page_size]
    planner = setup.planner(next_n=next_n)
    modes = modes_for(next_n)
    captured_all = capture_all(planner, SIZES, modes, setup.table)
    for _ in range(6):
        mode = rng.choice(modes)
        batch = setup.batch(rng, next_n=next_n, mode=mode)
        bs, replayed = replay_smallest(planner, batch, SIZES)
        captured, ptrs = captured_all[(mode, bs)]
        assert replayed is captured
        assert pointers(replayed) == ptrs
        _check_host_args(replayed, batch.bs)
        planner.verify(batch, replayed)  # eager padded to bs: bit-equal, padding holds pad values
        eager = planner.plan(batch)
        for backend in eager:
            e, r = eager[backend], replayed[backend]
            total = int(e.kv_indptr[-1])
            assert torch.equal(e.kv_indptr, r.kv_indptr[: batch.bs + 1])
            assert torch.equal(e.kv_indices[:total], r.kv_indices[:total])
            assert not r.kv_indices[int(r.kv_indptr[-1]) :].any()
            assert e.max_seq_len == int(batch.seq_lens_cpu.max())
            assert r.max_seq_len == MAX_CTX
        _check_host_args(eager, batch.bs)


@pytest.mark.triton(device=DEVICE)
def test_forced_triton_providers_plan_what_torch_plans():
    forced = {
        "paged_kv_indices": "triton",
        "pages_per_request": "triton",
        "last_page_len": "triton",
    }
    setup = SETUPS[16]
    table = setup.table
    a, b = (
        setup.planner(["flashinfer_decode"]),
        setup.planner(["flashinfer_decode"], providers=forced),
    )
    assert b.providers_chosen()["flashinfer_decode.kv_indices"] == "triton"
    a.capture(4, req_to_token=table)
    b.capture(4, req_to_token=table)
    rng = random.Random(3)
    for _ in range(3):
        batch = setup.batch(rng, max_batch=4)
        pa, pb = a.replay(batch, 4)["flashinfer_decode"], b.replay(batch, 4)["flashinfer_decode"]
        a.record(4)  # what the graph runs on replay
        b.record(4)
        for name, tensor in pa.tensors().items():
            assert torch.equal(tensor, getattr(pb, name)), name


def test_host_op_runs_once_per_batch_outside_the_graph():
    planner = SETUPS[1].planner()
    steps = planner.program(ForwardMode.DECODE).steps
    host = [s for s in steps if s.op_name == "flashinfer_plan"]
    assert len(host) == 2 and not any(s.in_graph for s in host)
    planner.capture(4, req_to_token=TABLES[1])
    planner.stats.reset()
    batch = SETUPS[1].batch(random.Random(1), max_batch=4)
    planner.replay(batch, 4)
    assert planner.stats.op_calls["flashinfer_plan"] == 2  # one per backend, never per layer


def test_without_flashinfer_the_host_op_is_bookkeeping_and_cannot_be_forced():
    if fi_ops.flashinfer_usable(DEVICE):
        pytest.skip("FlashInfer is usable here")
    chosen = SETUPS[1].planner().providers_chosen()
    assert chosen["flashinfer_decode.plan_info"] == chosen["flashinfer_mla.plan_info"] == "torch"
    with pytest.raises(ProviderError):
        SETUPS[1].planner(providers={"flashinfer_plan": "flashinfer"})


def test_static_flat_page_list_is_sized_from_limits():
    planner = SETUPS[16].planner(["flashinfer_decode"])
    plans = planner.capture(2, req_to_token=TABLES[16])
    plan = plans["flashinfer_decode"]
    pages = -(-MAX_CTX // 16)
    assert plan.kv_indices.shape == (2 * pages,)
    held = plan.kv_indices.untyped_storage().nbytes() // plan.kv_indices.element_size()
    assert held == MAX_BATCH * pages  # the leading part of a buffer of the largest size


@pytest.mark.parametrize(
    ("backend", "options", "page_size"),
    [
        ("flashinfer_decode", {"num_qo_heads": 6, "num_kv_heads": 4}, 16),
        ("flashinfer_decode", {"head_dim": 96}, 16),
        ("flashinfer_decode", {"q_dtype": "float32"}, 16),
        ("flashinfer_decode", {"decode_sm_scale": -1.0}, 16),
        ("flashinfer_mla", {}, 16),
        ("flashinfer_mla", {"head_dim_ckv": 128}, 64),
        ("flashinfer_mla", {"mla_backend": "cutlass"}, 64),
    ],
)
def test_unsupported_settings_are_refused_at_build(backend, options, page_size):
    limits = Limits(max_batch=4, max_context=64, page_size=page_size)
    with pytest.raises(SchemaError):
        Planner([backend], limits, options={backend: options})


# --- attention through plans -----------------------------------------------------------


def _dense(batch, kv_lens_of, q, keys, values, scale, next_n):
    """Attention straight from the batch: slots from req_to_token, float64, a loop."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys.shape[1]
    for r, (req, length) in enumerate(
        zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu.tolist(), strict=True)
    ):
        slots = batch.req_to_token[req, :length].long()
        k = keys[slots].double().repeat_interleave(group, dim=1)
        v = (values if values is not None else keys)[slots].double().repeat_interleave(group, dim=1)
        for i in range(next_n):
            n = length - (next_n - 1 - i)
            row = r * next_n + i
            logits = kv_lens_of(q[row].double(), k[:n]) * scale
            out[row] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), v[:n])
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("next_n", [1, 3])
def test_reference_decode_through_plans_equals_dense(page_size, next_n):
    setup, table = SETUPS[page_size], TABLES[page_size]
    g = torch.Generator().manual_seed(page_size * 10 + next_n)
    planner = setup.planner(["flashinfer_decode"], next_n=next_n)
    mode = mode_for(next_n)
    batch = setup.batch(random.Random(next_n), next_n=next_n, mode=mode, bs=5)
    slots = int(table.max()) + 1
    pages = -(-slots // page_size)
    k = torch.randn(pages, page_size, 2, 64, generator=g)
    v = torch.randn(pages, page_size, 2, 64, generator=g)
    q = torch.randn(5 * next_n, 4, 64, generator=g)
    expected = _dense(
        batch,
        lambda qh, kt: torch.einsum("hd,thd->ht", qh, kt),
        q,
        k.view(-1, 2, 64),
        v.view(-1, 2, 64),
        64**-0.5,
        next_n,
    )
    eager = planner.plan(batch)["flashinfer_decode"]
    got = flashinfer_decode_attention(eager, q, (k, v))
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.allclose(
        reference_decode_attention(eager, q, torch.stack([k, v], 1)).double(), expected, atol=1e-5
    )
    planner.capture(8, mode, req_to_token=table)
    replayed = planner.replay(batch, 8)["flashinfer_decode"]
    planner.record(8, mode)
    q8 = torch.cat([q, torch.randn(3 * next_n, 4, 64, generator=g)])
    got8 = flashinfer_decode_attention(replayed, q8, (k, v))
    assert torch.allclose(got8[: 5 * next_n].double(), expected, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("next_n", [1, 2])
def test_reference_mla_through_plans_equals_dense(page_size, next_n):
    setup, table = SETUPS[page_size], TABLES[page_size]
    g = torch.Generator().manual_seed(page_size + next_n)
    planner = setup.planner(["flashinfer_mla"], next_n=next_n)
    mode = mode_for(next_n)
    batch = setup.batch(random.Random(page_size), next_n=next_n, mode=mode, bs=4)
    pages = -(-(int(table.max()) + 1) // page_size)
    ckv = torch.randn(pages, page_size, 512, generator=g) * 0.1
    kpe = torch.randn(pages, page_size, 64, generator=g)
    q_nope = torch.randn(4 * next_n, 2, 512, generator=g) * 0.1
    q_pe = torch.randn(4 * next_n, 2, 64, generator=g)
    scale = 192**-0.5
    kv = torch.cat([ckv, kpe], -1).view(-1, 1, 576)
    q = torch.cat([q_nope, q_pe], -1)
    expected = _dense(
        batch, lambda qh, kt: torch.einsum("hd,thd->ht", qh, kt), q, kv, None, scale, next_n
    )[..., :512]
    eager = planner.plan(batch)["flashinfer_mla"]
    got = flashinfer_mla_attention(eager, q_nope, q_pe, ckv, kpe)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    planner.capture(4, mode, req_to_token=table)
    replayed = planner.replay(batch, 4)["flashinfer_mla"]
    planner.record(4, mode)
    assert torch.allclose(
        reference_mla_attention(replayed, q_nope, q_pe, ckv, kpe).double(), expected, atol=1e-5
    )


def test_attention_refuses_rows_that_do_not_match_the_plan():
    planner = SETUPS[16].planner(["flashinfer_decode"])
    batch = SETUPS[16].batch(random.Random(2), bs=3)
    plan = planner.plan(batch)["flashinfer_decode"]
    cache = torch.zeros(200, 16, 2, 64)
    with pytest.raises(PlanError, match="rows"):
        flashinfer_decode_attention(plan, torch.zeros(4, 4, 64), (cache, cache))
    with pytest.raises(PlanError, match="implementation"):
        flashinfer_decode_attention(plan, torch.zeros(3, 4, 64), (cache, cache), impl="cuda")
    with pytest.raises(PlanError, match="another FlashInfer kernel"):
        flashinfer_mla_attention(plan, torch.zeros(3, 2, 512), torch.zeros(3, 2, 64), cache, cache)


# --- the wrapper plumbing, against a fake FlashInfer -----------------------------------


class _FakeWrapper:
    """FlashInfer's contract, minus the kernels: what plan() may read, what run() reads."""

    made: list[_FakeWrapper] = []

    def __init__(self, workspace, *, graph, buffers, kind):
        self.kind, self.graph, self.buffers = kind, graph, buffers
        self.planned = None
        _FakeWrapper.made.append(self)

    def _host(self, *tensors):
        for t in tensors:  # plan() calls .to("cpu") on these: device tensors would sync
            assert t.device.type == "cpu" and (t.is_pinned() or not torch.cuda.is_available())

    def _bind(self, names, values, indices):
        if self.graph:
            for name, value in zip(names, values, strict=True):
                self.buffers[name].copy_(value)
            self.buffers["indices"][: len(indices)].copy_(indices)
        else:
            self.buffers = {name: value.clone() for name, value in zip(names, values, strict=True)}
            self.buffers["indices"] = indices

    def _pages(self, r, page_size):
        indptr, indices = self.buffers["indptr"], self.buffers["indices"]
        pages = indices[int(indptr[r]) : int(indptr[r + 1])].long()
        return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


class _FakeDecode(_FakeWrapper):
    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, **buffers):
        bufs = {
            "indptr": buffers.get("paged_kv_indptr_buffer"),
            "indices": buffers.get("paged_kv_indices_buffer"),
            "last": buffers.get("paged_kv_last_page_len_buffer"),
        }
        super().__init__(workspace, graph=use_cuda_graph, buffers=bufs, kind="decode")

    def plan(
        self,
        indptr,
        indices,
        last,
        heads,
        kv_heads,
        head_dim,
        page_size,
        *,
        q_data_type,
        kv_data_type,
        sm_scale,
        non_blocking,
    ):
        self._host(indptr, last)
        self._bind(("indptr", "last"), (indptr, last), indices)
        self.planned = SimpleNamespace(
            page_size=page_size, reqs=len(last), scale=sm_scale or head_dim**-0.5
        )

    def run(self, q, kv_cache):
        p = self.planned
        k, v = kv_cache
        out = torch.zeros_like(q)
        for r in range(p.reqs):
            tokens = self._pages(r, p.page_size)
            n = (len(tokens) // p.page_size - 1) * p.page_size + int(self.buffers["last"][r])
            kk = k.reshape(-1, *k.shape[2:])[tokens[:n]].repeat_interleave(
                q.shape[1] // k.shape[2], 1
            )
            vv = v.reshape(-1, *v.shape[2:])[tokens[:n]].repeat_interleave(
                q.shape[1] // k.shape[2], 1
            )
            w = torch.softmax(torch.einsum("hd,thd->ht", q[r], kk) * p.scale, -1)
            out[r] = torch.einsum("ht,thd->hd", w, vv)
        return out


class _FakeMLA(_FakeWrapper):
    def __init__(
        self,
        workspace,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        bufs = {"qo": qo_indptr, "indptr": kv_indptr, "indices": kv_indices, "lens": kv_len_arr}
        super().__init__(workspace, graph=use_cuda_graph, buffers=bufs, kind="mla")

    def plan(
        self,
        qo,
        indptr,
        indices,
        lens,
        heads,
        ckv,
        kpe,
        page_size,
        causal,
        scale,
        q_dtype,
        kv_dtype,
    ):
        self._host(qo, indptr, lens)
        self._bind(("qo", "indptr", "lens"), (qo, indptr, lens), indices)
        self.planned = SimpleNamespace(
            page_size=page_size, causal=causal, scale=scale, qo=qo.clone(), lens=lens.clone()
        )

    def run(self, q_nope, q_pe, ckv, kpe):
        p = self.planned
        out = torch.zeros_like(q_nope)
        latent, rope = ckv.reshape(-1, ckv.shape[-1]), kpe.reshape(-1, kpe.shape[-1])
        for r in range(len(p.lens)):
            tokens = self._pages(r, p.page_size)[: int(p.lens[r])]
            rows = range(int(p.qo[r]), int(p.qo[r + 1]))
            for i, row in enumerate(rows):
                n = len(tokens) - (len(rows) - 1 - i) if p.causal else len(tokens)
                t = tokens[:n]
                logits = (q_nope[row] @ latent[t].T + q_pe[row] @ rope[t].T) * p.scale
                out[row] = torch.softmax(logits, -1) @ latent[t]
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    _FakeWrapper.made.clear()
    return install_fake_flashinfer(
        monkeypatch,
        BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
        BatchMLAPagedAttentionWrapper=_FakeMLA,
    )


def test_wrappers_per_size_bound_to_static_plans_and_planned_every_replay(fake_flashinfer):
    setup, table = SETUPS[1], TABLES[1]
    planner = setup.planner(providers={"flashinfer_plan": "flashinfer"})
    g = torch.Generator().manual_seed(0)
    pages = int(table.max()) + 1
    k, v = torch.randn(pages, 1, 2, 64, generator=g), torch.randn(pages, 1, 2, 64, generator=g)
    ckv, kpe = torch.randn(pages, 1, 512, generator=g) * 0.1, torch.randn(pages, 1, 64, generator=g)
    captured = {bs: planner.capture(bs, req_to_token=table) for bs in SIZES}
    graph_wrappers = [w for w in _FakeWrapper.made if w.graph]
    assert len(graph_wrappers) == 2 * len(SIZES)  # one per (size, backend), made at capture
    for plans in captured.values():
        slot = plans["flashinfer_decode"].wrapper.slot
        for bound, field in (("indptr", "kv_indptr"), ("indices", "kv_indices")):
            mine = getattr(plans["flashinfer_decode"], field)  # the plan's memory, bound
            assert slot.wrapper.buffers[bound].data_ptr() == mine.data_ptr()
            assert slot.wrapper.buffers[bound].shape == mine.shape
    rng = random.Random(4)
    for _ in range(5):
        bs, plans = replay_smallest(planner, setup.batch(rng), SIZES)
        assert plans is captured[bs]
        d, m = plans["flashinfer_decode"], plans["flashinfer_mla"]
        q = torch.randn(bs, 4, 64, generator=g)
        qn, qp = torch.randn(bs, 2, 512, generator=g) * 0.1, torch.randn(bs, 2, 64, generator=g)
        assert torch.allclose(
            flashinfer_decode_attention(d, q, (k, v)),
            reference_decode_attention(d, q, (k, v)),
            atol=1e-5,
        )
        assert torch.allclose(
            flashinfer_mla_attention(m, qn, qp, ckv, kpe),
            reference_mla_attention(m, qn, qp, ckv, kpe),
            atol=1e-5,
        )
    assert len([w for w in _FakeWrapper.made if w.graph]) == 2 * len(SIZES)  # none made at replay


def test_eager_wrapper_is_reused_and_a_superseded_plan_is_refused(fake_flashinfer):
    setup = SETUPS[64]
    planner = setup.planner(
        ["flashinfer_mla"], next_n=2, providers={"flashinfer_plan": "flashinfer"}
    )
    rng = random.Random(5)
    ckv, kpe = torch.randn(200, 64, 512) * 0.1, torch.randn(200, 64, 64)
    first = planner.plan(setup.batch(rng, next_n=2, mode=ForwardMode.TARGET_VERIFY, bs=3))[
        "flashinfer_mla"
    ]
    qn, qp = torch.randn(6, 2, 512) * 0.1, torch.randn(6, 2, 64)
    got = flashinfer_mla_attention(first, qn, qp, ckv, kpe)
    assert torch.allclose(got, reference_mla_attention(first, qn, qp, ckv, kpe), atol=1e-5)
    second = planner.plan(setup.batch(rng, bs=5))["flashinfer_mla"]
    assert len(_FakeWrapper.made) == 2  # one eager wrapper per mode (next_n), reused across batches
    planner.plan(setup.batch(rng, bs=2))
    assert len(_FakeWrapper.made) == 2
    with pytest.raises(PlanError, match="newer eager plan"):
        flashinfer_mla_attention(
            second, torch.zeros(5, 2, 512), torch.zeros(5, 2, 64), ckv, kpe, impl="flashinfer"
        )


def test_decode_wrapper_refuses_target_verify(fake_flashinfer):
    planner = SETUPS[16].planner(
        ["flashinfer_decode"], next_n=2, providers={"flashinfer_plan": "flashinfer"}
    )
    planner.capture(2, ForwardMode.DECODE, req_to_token=TABLES[16])
    with pytest.raises(PlanError, match="prefill wrapper"):
        planner.capture(2, ForwardMode.TARGET_VERIFY, req_to_token=TABLES[16])


def test_importing_the_backend_never_imports_flashinfer():
    code = (
        "import sys, backends.flashinfer, planner; planner.all_backends(); "
        "assert 'flashinfer' not in sys.modules, 'imported'; print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
