"""The ragged (per-token) metadata ops: references against a plain Python model of an
extend batch, Triton kernels bit for bit against the references, padding as documented.

Batches cover one request, tokens exactly at capacity, decode (every extend length 1),
long cached prefixes and the idle batch (no requests). Without CUDA the Triton kernels
run under the interpreter (tests/conftest.py), so their cases stay small.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.common import ragged_ref as ref
from backends.common import ragged_triton as tri
from backends.common import torch_ref
from backends.deepgemm import reference_fp8_mqa_logits
from planner.errors import PlanError
from planner.ops import get_op

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32
IMPLS = [
    pytest.param(ref, id="torch"),
    pytest.param(tri, id="triton", marks=pytest.mark.triton(device=DEVICE)),
]
OPS = [
    "token_request",
    "token_positions",
    "token_causal_lengths",
    "token_topk_lengths",
    "token_kv_ranges",
    "kv_gather_slots",
]


def _t(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _garbage(*shape: int) -> torch.Tensor:
    # Pre-filled so an element a kernel forgets to write cannot pass as a valid value.
    return torch.full(shape, -7, dtype=I32, device=DEVICE)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = _garbage(lengths.shape[0] + 1)
    torch_ref.cumsum_with_zero(out, lengths)  # what the planner's op computes
    return out


def make_batch(
    rng: random.Random,
    reqs: int,
    *,
    max_extend: int = 6,
    max_prefix: int = 20,
    decode: bool = False,
    slack: int = 3,
    kv_slack: int = 4,
    pool: int | None = None,
) -> dict:
    """One extend batch: lengths, offsets, a request pool and the static capacities."""
    extend = [1 if decode else rng.randint(1, max_extend) for _ in range(reqs)]
    seq = [e + rng.randint(0, max_prefix) for e in extend]
    ctx = max(seq, default=1) + rng.randint(0, 3)
    pool = pool or reqs + 2
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    table = torch.randint(1, 10**6, (pool, ctx), generator=gen, dtype=I32)
    return dict(
        extend=extend,
        seq=seq,
        table=table,
        pool_idx=rng.sample(range(pool), reqs),
        max_tokens=sum(extend) + slack,
        kv_cap=sum(seq) + kv_slack,
        pad=rng.randint(0, reqs + 1),
        topk=rng.randint(1, max(seq, default=1) + 2),
    )


def tensors(batch: dict) -> dict:
    seq, ext = _t(batch["seq"]), _t(batch["extend"])
    return dict(
        qo=_indptr(ext),
        kv=_indptr(seq),
        seq=seq,
        table=batch["table"].to(DEVICE),
        pool_idx=_t(batch["pool_idx"], torch.int64),
    )


def call(impl, name: str, batch: dict, t: dict) -> torch.Tensor:
    """Run op ``name`` of ``impl`` into a garbage-filled ``out``; returns ``out``."""
    n = batch["max_tokens"]
    shape = (2, n) if name == "token_kv_ranges" else (n,)
    out = _garbage(*(shape if name != "kv_gather_slots" else (batch["kv_cap"],)))
    assert getattr(impl, name)(out, *_inputs(name, batch, t)) is None
    return out


def _inputs(name: str, batch: dict, t: dict) -> tuple:
    return {
        "token_request": (t["qo"], batch["pad"]),
        "token_positions": (t["qo"], t["seq"]),
        "token_causal_lengths": (t["qo"], t["seq"]),
        "token_topk_lengths": (t["qo"], t["seq"], batch["topk"]),
        "token_kv_ranges": (t["qo"], t["kv"]),
        "kv_gather_slots": (t["table"], t["pool_idx"], t["kv"]),
    }[name]


def model(name: str, batch: dict) -> list:
    """The op's semantics as a plain loop over requests and their tokens."""
    owner, pos, kv_start, slots, start = [], [], [], [], 0
    for b, (s, e) in enumerate(zip(batch["seq"], batch["extend"])):
        slots += batch["table"][batch["pool_idx"][b], :s].tolist()
        for i in range(e):
            owner.append(b)
            pos.append(s - e + i)  # prefix length + offset
            kv_start.append(start)
        start += s
    pad = batch["max_tokens"] - len(owner)
    if name == "token_request":
        return owner + [batch["pad"]] * pad
    if name == "token_positions":
        return pos + [0] * pad
    if name == "token_causal_lengths":
        return [p + 1 for p in pos] + [1] * pad
    if name == "token_topk_lengths":
        return [min(p + 1, batch["topk"]) for p in pos] + [1] * pad
    if name == "token_kv_ranges":
        ke = [s + p + 1 for s, p in zip(kv_start, pos)]
        return [kv_start + [0] * pad, ke + [1] * pad]
    if name == "kv_gather_slots":
        return slots + [0] * (batch["kv_cap"] - len(slots))
    raise AssertionError(name)


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked_batch_and_padding_values(impl):
    """3 requests: (KV 5, 2 new), (KV 1, 1 new), (KV 10, 3 new); 8 token rows, 20 KV entries."""
    qo, seq, kv = _t([0, 2, 3, 6]), _t([5, 1, 10]), _t([0, 5, 6, 16])
    out = _garbage(8)
    impl.token_request(out, qo, 3)
    assert out.tolist() == [0, 0, 1, 2, 2, 2, 3, 3]
    impl.token_positions(out, qo, seq)
    assert out.tolist() == [3, 4, 0, 7, 8, 9, 0, 0]
    impl.token_causal_lengths(out, qo, seq)
    assert out.tolist() == [4, 5, 1, 8, 9, 10, 1, 1]
    impl.token_topk_lengths(out, qo, seq, 8)
    assert out.tolist() == [4, 5, 1, 8, 8, 8, 1, 1]
    ranges = _garbage(2, 8)
    impl.token_kv_ranges(ranges, qo, kv)
    assert ranges.tolist() == [[0, 0, 5, 6, 6, 6, 0, 0], [4, 5, 6, 14, 15, 16, 1, 1]]
    table = torch.arange(100, dtype=I32, device=DEVICE).view(4, 25) + 1000
    slots = _garbage(20)
    impl.kv_gather_slots(slots, table, _t([2, 0, 3], torch.int64), kv)
    assert (
        slots.tolist() == [1050, 1051, 1052, 1053, 1054, 1000] + list(range(1075, 1085)) + [0] * 4
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_idle_batch_is_all_padding(impl):
    qo, empty = _t([0]), _t([])
    table = torch.full((1, 1), 9, dtype=I32)
    batch = dict(max_tokens=5, kv_cap=4, pad=2, topk=3, seq=[], extend=[], table=table, pool_idx=[])
    t = dict(qo=qo, kv=qo, seq=empty, table=table.to(DEVICE), pool_idx=_t([], torch.int64))
    for name in OPS:
        assert call(impl, name, batch, t).tolist() == model(name, batch), name


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_capacity_and_narrow_request_table(impl):
    qo, seq = _t([0, 2]), _t([4])
    impl.token_positions(_garbage(0), qo, seq)  # nothing to write, nothing read
    slots = _garbage(6)
    impl.kv_gather_slots(slots, _t([[7, 8]]), _t([0]), _t([0, 4]))  # ctx 2 < seq_len 4
    assert slots.tolist() == [7, 8, 0, 0, 0, 0]


# --------------------------------------------------------------------------- references


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.integers(1, 12),
    shape=st.sampled_from(["mixed", "decode", "long_prefix", "single_token"]),
    slack=st.sampled_from([0, 0, 1, 7]),  # 0: tokens exactly at capacity
    seed=st.integers(0, 2**32 - 1),
)
def test_references_match_the_loop_model(reqs, shape, slack, seed):
    rng = random.Random(seed)
    kw = dict(slack=slack, kv_slack=rng.choice([0, 3]))
    if shape == "decode":
        kw["decode"] = True
    elif shape == "long_prefix":
        kw.update(max_prefix=100_000, max_extend=3)
    elif shape == "single_token":
        kw.update(max_prefix=0, max_extend=1)
    if shape == "long_prefix":
        batch = _long(rng, min(reqs, 3), kw)
    else:
        batch = make_batch(rng, reqs, **kw)
    t = tensors(batch)
    for name in OPS:
        assert call(ref, name, batch, t).tolist() == model(name, batch), name


def _long(rng: random.Random, reqs: int, kw: dict) -> dict:
    """50k-100k-token cached prefixes behind a few new tokens each."""
    batch = make_batch(rng, reqs, **(kw | {"max_prefix": 0}))
    batch["seq"] = [e + rng.randint(50_000, 100_000) for e in batch["extend"]]
    width = max(batch["seq"])
    rows = batch["table"].shape[0]
    batch["table"] = torch.arange(rows * width, dtype=I32).view(rows, width) + 1
    batch["kv_cap"] = sum(batch["seq"]) + kw["kv_slack"]
    return batch


# --------------------------------------------------------------------------- triton


TRITON_CASES = [
    # reqs, options
    (1, dict(max_extend=1, max_prefix=0, slack=0)),  # one token, at capacity
    (1, dict(max_extend=2000, max_prefix=50)),  # one long prefill over two blocks
    (5, dict(slack=0)),
    (64, dict(decode=True, slack=30)),
    (200, dict(max_extend=9, slack=100)),  # a deeper search, several blocks
    (3, dict(max_prefix=100_000, max_extend=4)),
]


@pytest.mark.triton(device=DEVICE)
@pytest.mark.parametrize(("reqs", "options"), TRITON_CASES)
def test_triton_bit_equal_to_the_reference(reqs, options):
    rng = random.Random(reqs * 31 + len(options))
    if options.get("max_prefix") == 100_000:
        batch = _long(rng, reqs, dict(slack=3, kv_slack=2, max_extend=4))
    else:
        batch = make_batch(rng, reqs, **options)
    t = tensors(batch)
    for name in OPS:
        expected = call(ref, name, batch, t)
        assert torch.equal(call(tri, name, batch, t), expected), name


@pytest.mark.triton(device=DEVICE)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.integers(1, 40), decode=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_triton_bit_equal_on_random_batches(reqs, decode, seed):
    rng = random.Random(seed)
    batch = make_batch(rng, reqs, decode=decode, slack=rng.choice([0, 5]), pool=reqs + 5)
    t = tensors(batch)
    for name in OPS:
        assert torch.equal(call(tri, name, batch, t), call(ref, name, batch, t)), name


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_last_token_rows_are_each_requests_last_n_rows(impl, n, seed):
    """``[reqs, n]``: every request's last ``n`` rows, a shorter one's first row repeated;
    padding requests (no tokens, after the real ones) the last real token's row. ``[reqs]``
    is ``n = 1``, the last row alone."""
    rng = random.Random(seed * 8 + n)
    extend = [rng.randint(1, 2 * n) for _ in range(rng.randint(1, 9))]
    padding = rng.randint(0, 3)
    qo = _indptr(_t(extend + [0] * padding))
    want, end = [], 0
    for e in extend:
        start, end = end, end + e
        want.append([max(end - n + i, start) for i in range(n)])
    want += [[end - 1] * n] * padding
    out = _garbage(len(extend) + padding, n)
    impl.last_token_rows(out, qo)
    assert out.tolist() == want
    if n == 1:
        flat = _garbage(len(extend) + padding)
        impl.last_token_rows(flat, qo)
        assert flat.tolist() == [row[0] for row in want]


@pytest.mark.parametrize("impl", IMPLS)
def test_garbage_offsets_still_write_everything_in_bounds(impl):
    """Offsets that are not cumulative lengths give meaningless values, but every element
    is written and every read stays in bounds (the kernels clamp the request index)."""
    gen = torch.Generator().manual_seed(0)
    qo = torch.randint(-50, 50, (7,), generator=gen, dtype=I32).to(DEVICE)
    seq = torch.randint(-9, 9, (6,), generator=gen, dtype=I32).to(DEVICE)
    owner = _garbage(40)
    impl.token_request(owner, qo, 99)
    assert ((owner >= 0) & (owner < 6) | (owner == 99)).all()
    for name in ("token_positions", "token_causal_lengths"):
        getattr(impl, name)(_garbage(40), qo, seq)
    slots = _garbage(40)
    table = torch.randint(1, 99, (6, 5), generator=gen, dtype=I32).to(DEVICE)
    impl.kv_gather_slots(slots, table, _t(list(range(6))), qo)
    assert ((slots == 0) | ((slots >= 1) & (slots < 99))).all()
    idle = _t([5])  # no requests, yet the single offset claims 5 tokens
    impl.token_positions(owner, idle, _t([]))
    assert owner.tolist() == [0] * 40
    impl.kv_gather_slots(slots, table, _t([]), idle)
    assert slots.tolist() == [0] * 40


# --------------------------------------------------------------------------- checks


def _bad_calls():
    qo, seq, kv = _t([0, 2, 3]), _t([4, 1]), _t([0, 4, 5])
    table, pool = _t([[1, 2, 3, 4]] * 3), _t([0, 2], torch.int64)
    out = _garbage(6)
    return [
        ("token_request", (out, qo.long(), 0), "qo_indptr"),
        ("token_request", (out.long(), qo, 0), "out"),
        ("token_request", (out, qo[:0], 0), "qo_indptr"),
        ("token_request", (out, qo, -1), "pad"),
        ("token_request", (out, qo, 2**31), "pad"),
        ("token_request", (out, qo, 1.0), "pad"),
        ("token_positions", (out, qo, seq[:1]), "seq_lens"),
        ("token_positions", (out, qo, seq.view(2, 1)), "seq_lens"),
        ("token_positions", (_garbage(6, 2)[:, 0], qo, seq), "out"),
        ("token_causal_lengths", (out.view(2, 3), qo, seq), "out"),
        ("token_causal_lengths", (out, qo, seq.float()), "seq_lens"),
        ("token_topk_lengths", (out, qo, seq, 0), "topk"),
        ("token_topk_lengths", (out, qo, seq, True), "topk"),
        ("token_kv_ranges", (out, qo, kv), "out"),
        ("token_kv_ranges", (_garbage(3, 6), qo, kv), "out"),
        ("token_kv_ranges", (_garbage(2, 6), qo, kv[:2]), "kv_indptr"),
        ("token_kv_ranges", (_garbage(2, 6), qo.view(1, 3), kv), "qo_indptr"),
        ("kv_gather_slots", (out, table, pool.float(), kv), "req_pool_indices"),
        ("kv_gather_slots", (out, table, pool[:1], kv), "req_pool_indices"),
        ("kv_gather_slots", (out, table[0], pool, kv), "req_to_token"),
        ("kv_gather_slots", (out, table, pool, kv.long()), "kv_indptr"),
        ("token_positions", (out, qo, torch.empty(2, dtype=I32, device="meta")), "seq_lens"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "args", "field"), BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_bad_arguments_are_refused_naming_the_field(impl, name, args, field):
    with pytest.raises(PlanError) as e:
        getattr(impl, name)(*args)
    assert e.value.field == field, str(e.value)


# --------------------------------------------------------------------------- use


def test_ops_are_registered_with_both_providers():
    from backends.common import ragged_ops  # noqa: F401  (registers the ops)

    for name in OPS:
        op = get_op(name)
        assert set(op.providers) == {"torch", "triton"} and op.doc
        assert op.select(torch.device("cpu")).fn is getattr(ref, name)
        assert op.providers["triton"].fn is getattr(tri, name)


def test_prefill_indexer_over_the_gathered_kv_is_causal_per_request():
    """ks/ke and the gathered slots drive deep_gemm's fp8_mqa_logits (reference) over the
    flat KV; each request's rows must equal that request alone, causally masked."""
    rng = random.Random(3)
    batch = make_batch(rng, 4, max_extend=5, max_prefix=6, slack=2, kv_slack=3)
    batch["table"] = batch["table"] % 199 + 1  # slots of a 200-slot KV pool
    t = tensors(batch)
    ranges = call(ref, "token_kv_ranges", batch, t)
    slots = call(ref, "kv_gather_slots", batch, t).long()
    gen = torch.Generator().manual_seed(3)
    k_pool = (torch.randn(200, 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    s_pool = torch.rand(200, generator=gen)
    n = batch["max_tokens"]
    q = (torch.randn(n, 4, 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    w = torch.randn(n, 4, generator=gen)
    flat = (k_pool[slots.cpu()], s_pool[slots.cpu()])
    got = reference_fp8_mqa_logits(q, flat, w, ranges[0].cpu(), ranges[1].cpu())
    row = 0
    for b, (s, e) in enumerate(zip(batch["seq"], batch["extend"])):
        own = batch["table"][batch["pool_idx"][b], :s].long()
        kv_b = (k_pool[own], s_pool[own])
        pos = torch.arange(s - e, s, dtype=I32)
        alone = reference_fp8_mqa_logits(
            q[row : row + e], kv_b, w[row : row + e], torch.zeros(e, dtype=I32), pos + 1
        )
        start = sum(batch["seq"][:b])
        assert torch.equal(got[row : row + e, start : start + s], alone)
        assert torch.isinf(got[row : row + e, :start]).all()
        assert torch.isinf(got[row : row + e, start + s :]).all()
        row += e
    assert torch.isfinite(got[row:, 0]).all() and torch.isinf(got[row:, 1:]).all()  # padding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", IMPLS)
def test_capturable_in_a_cuda_graph(impl):
    """Capture proves no host sync and no output allocation; replay after rewriting the
    inputs in place (a different ragged batch, same shapes) proves the graph reads them."""
    rng = random.Random(5)
    first = make_batch(rng, 6, slack=40, kv_slack=40, pool=8)
    t = tensors(first)
    outs = {name: call(impl, name, first, t) for name in OPS}  # compiles, warms up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            for name in OPS:
                n = outs[name]
                getattr(impl, name)(n, *_inputs(name, first, t))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    second = make_batch(random.Random(6), 6, slack=0, kv_slack=0, pool=8)
    second.update(max_tokens=first["max_tokens"], kv_cap=first["kv_cap"])
    second.update(pad=first["pad"], topk=first["topk"], table=first["table"])
    fresh = tensors(second)
    for key in ("qo", "kv", "seq", "pool_idx"):
        t[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    for name in OPS:
        assert torch.equal(outs[name], call(ref, name, second, fresh)), name
