"""FlashInfer backends on the CPU: metadata ops, the three phases, the host op.

Without CUDA the Triton kernels run under the interpreter, switched on before
``triton.language`` is first imported (see ``backends.kernels.generic_triton``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.flashinfer import kernels as tri  # noqa: E402
from backends.flashinfer import reference as ref  # noqa: E402
from backends.flashinfer import release_wrappers, wrappers  # noqa: E402
from planner import ForwardMode, Limits, Planner, SchemaError  # noqa: E402
from tests.batches import make_pool, random_batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32
MAX_BATCH, MAX_CTX = 8, 150
SIZES = [1, 2, 4, MAX_BATCH]
TABLES = {ps: make_pool(24, MAX_CTX, ps, seed=ps) for ps in (1, 16, 64)}
MLA_OPTIONS = {"num_heads": 2}
DECODE_OPTIONS = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64}

needs_triton = pytest.mark.skipif(
    not tri.triton_usable(DEVICE), reason=f"Triton cannot run on {DEVICE}"
)
IMPLS = [pytest.param(ref, id="torch"), pytest.param(tri, id="triton", marks=needs_triton)]


@pytest.fixture(autouse=True)
def _fresh_pool():
    release_wrappers()
    yield
    release_wrappers()


def _t(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _garbage(n: int) -> torch.Tensor:
    return torch.full((n,), -7, dtype=I32, device=DEVICE)  # an unwritten element cannot pass as 0


def _planner(
    page_size: int, next_n: int = 1, backends=("flashinfer_decode", "flashinfer_mla"), **kw
) -> Planner:
    options = {"flashinfer_decode": DECODE_OPTIONS, "flashinfer_mla": MLA_OPTIONS}
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CTX, page_size=page_size, next_n=next_n)
    return Planner(list(backends), limits, options={b: options[b] for b in backends}, **kw)


# --- ops: hand-checked, and Triton equal to the reference ---------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_per_request_page_tables(impl):
    out = _garbage(5)
    impl.pages_per_request(out, _t([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 1, 2, 2, 3]
    impl.last_page_len(out, _t([1, 16, 17, 32, 33]), 16)
    assert out.tolist() == [1, 16, 1, 16, 1]
    impl.last_page_len(out, _t([1, 2, 3, 4, 5]), 1)
    assert out.tolist() == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_kv_indices_example(impl):
    # page_size 4; request 0 (pool row 2) has 6 tokens = 2 pages, request 1 (row 1) 1 token.
    table = _t([[0] * 8, [40, 41, 42, 43, 44, 45, 46, 47], [12, 13, 14, 15, 28, 29, 30, 31]])
    indptr = _t([0, 2, 3])
    out = _garbage(2 * 3)  # capacity: 2 requests x 3 pages
    impl.paged_kv_indices(out, table, _t([2, 1], torch.int64), indptr, 4)
    assert out.tolist() == [3, 7, 10, 0, 0, 0]
    unit = _garbage(2 * 4)
    impl.paged_kv_indices(unit, table[:, :4], _t([1, 2]), _t([0, 3, 4]), 1)
    assert unit.tolist() == [40, 41, 42, 12, 0, 0, 0, 0]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    reqs=st.integers(1, 9),
    page_size=st.sampled_from([1, 2, 16, 64]),
    spare=st.integers(0, 3),
)
@needs_triton
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
    expected, actual = _garbage(reqs * width), _garbage(reqs * width)
    ref.paged_kv_indices(expected, *args)
    tri.paged_kv_indices(actual, *args)
    assert torch.equal(expected.cpu(), actual.cpu())
    total = int(indptr[-1])
    assert not expected[total:].any()
    first = (table[pool[0], 0] // page_size).item()
    assert expected[0].item() == first


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 3, 64]))
@needs_triton
def test_triton_page_split_equals_reference(seed, page_size):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(
        -5, 1 << 20, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g, dtype=I32
    )
    for name in ("pages_per_request", "last_page_len"):
        expected, actual = _garbage(lens.shape[0]), _garbage(lens.shape[0])
        getattr(ref, name)(expected, lens.to(DEVICE), page_size)
        getattr(tri, name)(actual, lens.to(DEVICE), page_size)
        assert torch.equal(expected.cpu(), actual.cpu()), name


# --- the three phases ------------------------------------------------------------------


def _check_host_args(plans, real: int) -> None:
    """What the host op recorded for FlashInfer equals the device plan fields, padding included."""
    for backend in plans:
        plan = plans[backend]
        slot = wrappers.POOL.lookup(plan.kv_indptr)
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
    table = TABLES[page_size]
    planner = _planner(page_size, next_n)
    modes = [ForwardMode.DECODE] + ([ForwardMode.TARGET_VERIFY] if next_n > 1 else [])
    pointers = {}
    for mode in modes:
        for bs in SIZES:
            plans = planner.capture(bs, mode, req_to_token=table)
            pointers[(mode, bs)] = (
                plans,
                {f"{b}.{k}": t.data_ptr() for b in plans for k, t in plans[b].tensors().items()},
            )
    for _ in range(6):
        mode = rng.choice(modes)
        batch = random_batch(
            rng, table, max_batch=MAX_BATCH, max_context=MAX_CTX, next_n=next_n, mode=mode
        )
        bs = min(s for s in SIZES if s >= batch.bs)
        replayed = planner.replay(batch, bs)
        planner.record(bs, mode)
        captured, ptrs = pointers[(mode, bs)]
        assert replayed is captured
        assert {
            f"{b}.{k}": t.data_ptr() for b in replayed for k, t in replayed[b].tensors().items()
        } == ptrs
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


def test_forced_triton_providers_plan_what_torch_plans():
    if not tri.triton_usable(DEVICE):
        pytest.skip("Triton cannot run here")
    forced = {
        "paged_kv_indices": "triton",
        "pages_per_request": "triton",
        "last_page_len": "triton",
    }
    table = TABLES[16]
    a, b = (
        _planner(16, backends=("flashinfer_decode",)),
        _planner(16, backends=("flashinfer_decode",), providers=forced),
    )
    assert b.providers_chosen()["flashinfer_decode.kv_indices"] == "triton"
    a.capture(4, req_to_token=table)
    b.capture(4, req_to_token=table)
    rng = random.Random(3)
    for _ in range(3):
        batch = random_batch(rng, table, max_batch=4, max_context=MAX_CTX)
        pa, pb = a.replay(batch, 4)["flashinfer_decode"], b.replay(batch, 4)["flashinfer_decode"]
        for name, tensor in pa.tensors().items():
            assert torch.equal(tensor, getattr(pb, name)), name


def test_host_op_runs_once_per_batch_outside_the_graph():
    planner = _planner(1)
    steps = planner.program(ForwardMode.DECODE).steps
    host = [s for s in steps if s.op_name == "flashinfer_plan"]
    assert len(host) == 2 and not any(s.in_graph for s in host)
    planner.capture(4, req_to_token=TABLES[1])
    planner.stats.reset()
    batch = random_batch(random.Random(1), TABLES[1], max_batch=4, max_context=MAX_CTX)
    planner.replay(batch, 4)
    assert planner.stats.op_calls["flashinfer_plan"] == 2  # one per backend, never per layer


def test_static_flat_page_list_is_sized_from_limits():
    planner = _planner(16, backends=("flashinfer_decode",))
    plans = planner.capture(2, req_to_token=TABLES[16])
    plan = plans["flashinfer_decode"]
    pages = -(-MAX_CTX // 16)
    assert plan.kv_indices.shape == (2 * pages,)
    assert plan.kv_indices._base.shape == (MAX_BATCH * pages,)


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


def test_importing_the_backend_never_imports_flashinfer():
    code = (
        "import sys, backends.flashinfer, planner; planner.all_backends(); "
        "assert 'flashinfer' not in sys.modules, 'imported'; print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
