"""CPU tests of the deep_gemm references: schedule, fp8 quantisation, cache layout, logits.

The schedule is checked three ways: against a line-by-line Python transliteration of the
0.1.0 (and newer) metadata kernel, against structural properties any valid schedule has,
and against hand-worked examples. The logits reference is checked against a plain
dequantise-then-matmul in float64.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.deepgemm import (
    FP8_MAX,
    PAGE,
    SPLIT_KV,
    _native,
    dequantize_fp8_per_vector,
    fp8_paged_mqa_logits,
    gather_index_cache,
    get_paged_mqa_logits_metadata,
    index_cache_views,
    new_index_cache,
    pack_index_kv_cache,
    paged_mqa_schedule_into,
    quantize_fp8_e4m3_per_vector,
    quantize_query,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
    schedule_units,
    unpack_index_kv_cache,
    write_index_cache,
)
from planner.errors import PlanError, ProviderError

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- schedule


def kernel_port(lens: list[list[int]], num_sms: int, layout: str) -> list[tuple[int, int]]:
    """The metadata kernel, one SM at a time, as the CUDA source reads (next_n 1 or 2)."""
    batch = len(lens)
    aligned = -(-batch // 32) * 32
    prefix, acc = [], 0
    for k in range(aligned):
        length = lens[k][-1] if k < batch else 0  # only the last column is read
        acc = (acc + -(-length // SPLIT_KV)) & 0xFFFFFFFF
        prefix.append(acc)
    total = acc
    q, r = divmod(total, num_sms)
    rows = []
    for sm in range(num_sms + 1):
        if layout == "new" and sm == num_sms:
            rows.append((batch, 0))  # written explicitly by newer builds
            continue
        if layout == "0.1.0":
            start = sm * q + min(sm, r)
        else:
            pivot = num_sms - r
            start = sm * q + (sm - pivot if sm > pivot else 0)
        lo, hi = 0, batch
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid] <= start:
                lo = mid + 1
            else:
                hi = mid
        qi = lo if layout == "0.1.0" else min(lo, batch - 1)
        offset = start if qi == 0 else start - prefix[qi - 1]
        # 0.1.0 reads past the shared array when qi == aligned; offset is 0 there anyway.
        nsq = prefix[qi] - (prefix[qi - 1] if qi > 0 else 0) if qi < aligned else 1
        atom = offset // nsq if nsq > 0 else 0
        split = offset % nsq if nsq > 0 else 0
        rows.append((qi + atom, split))
    return rows


def make_lens(batch: int, next_n: int, max_len: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        last = torch.randint(1, max_len + 1, (batch,), generator=g)
    elif kind == "equal":
        last = torch.full((batch,), int(torch.randint(1, max_len + 1, (1,), generator=g)))
    elif kind == "skewed":
        last = torch.randint(1, 300, (batch,), generator=g)
        big = torch.randint(0, batch, (max(1, batch // 16),), generator=g)
        last[big] = torch.randint(max_len // 2 + 1, max_len + 1, (big.numel(),), generator=g)
    else:  # split boundaries: multiples of 256, +-1
        m = torch.randint(1, max(2, max_len // SPLIT_KV), (batch,), generator=g) * SPLIT_KV
        last = (m + torch.randint(-1, 2, (batch,), generator=g)).clamp(1, max_len)
    last = last.clamp(min=next_n)  # a planner pads every request to >= next_n tokens
    cols = [last - (next_n - 1 - i) for i in range(next_n)]
    return torch.stack(cols, dim=1).to(torch.int32).contiguous()


lens_params = st.tuples(
    st.integers(1, 1024),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 300, 5000, 200_000]),
    st.sampled_from(["uniform", "equal", "skewed", "splits"]),
    st.integers(0, 2**31 - 1),
)


@FAST
@given(params=lens_params, num_sms=st.sampled_from([1, 8, 78, 132]))
def test_schedule_matches_kernel_port(params, num_sms):
    lens = make_lens(*params)
    for layout in ("0.1.0", "new"):
        got = reference_paged_mqa_schedule(lens, 64, num_sms, layout)
        assert got.dtype == torch.int32 and got.shape == (num_sms + 1, 2)
        assert [tuple(r) for r in got.tolist()] == kernel_port(lens.tolist(), num_sms, layout)


def unit_starts(schedule: torch.Tensor, lens: torch.Tensor) -> list[int]:
    excl = [0] + torch.cumsum(schedule_units(lens), 0).tolist()
    return [excl[r] + s for r, s in schedule.tolist()]


@FAST
@given(params=lens_params, num_sms=st.sampled_from([1, 8, 78, 132]))
def test_schedule_properties(params, num_sms):
    lens = make_lens(*params)
    batch = lens.shape[0]
    units = schedule_units(lens).tolist()
    total = sum(units)
    q, r = divmod(total, num_sms)
    sizes = {}
    for layout in ("0.1.0", "new"):
        sched = reference_paged_mqa_schedule(lens, 64, num_sms, layout)
        assert sched[-1].tolist() == [batch, 0]  # the last row is the end
        for req, split in sched[:-1].tolist():  # each start lies inside the work (or at its end)
            assert (0 <= req < batch and 0 <= split < units[req]) or (req, split) == (batch, 0)
        starts = unit_starts(sched, lens)
        assert starts[0] == 0 and starts[-1] == total
        sizes[layout] = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        assert all(s in (q, q + 1) for s in sizes[layout])  # split evenly to one unit
    # 0.1.0 hands the remainder to the first SMs, newer builds to the last ones
    assert sizes["0.1.0"] == [q + 1] * r + [q] * (num_sms - r)
    assert sizes["new"] == [q] * (num_sms - r) + [q + 1] * r


def test_schedule_hand_example():
    # units: ceil([1000, 5, 70000, 300] / 256) = [4, 1, 274, 2], total 281 = 8 * 35 + 1
    lens = torch.tensor([[1000], [5], [70000], [300]], dtype=torch.int32)
    old = reference_paged_mqa_schedule(lens, 64, 8, "0.1.0").tolist()
    new = reference_paged_mqa_schedule(lens, 64, 8, "new").tolist()
    assert old[:3] == [[0, 0], [2, 31], [2, 66]] and old[-1] == [4, 0]
    assert new[:3] == [[0, 0], [2, 30], [2, 65]] and new[-2:] == [[2, 240], [4, 0]]


def test_schedule_reads_only_last_column_for_mtp():
    a = torch.tensor([[255, 256], [511, 512]], dtype=torch.int32)
    b = torch.tensor([[1, 256], [3, 512]], dtype=torch.int32)
    assert torch.equal(
        reference_paged_mqa_schedule(a, 64, 3), reference_paged_mqa_schedule(b, 64, 3)
    )


def test_schedule_more_sms_than_units():
    lens = torch.tensor([[10], [300]], dtype=torch.int32)  # 3 units on 8 SMs
    old = reference_paged_mqa_schedule(lens, 64, 8, "0.1.0").tolist()
    new = reference_paged_mqa_schedule(lens, 64, 8, "new").tolist()
    assert old == [[0, 0], [1, 0], [1, 1]] + [[2, 0]] * 6
    assert new == [[0, 0]] * 6 + [[1, 0], [1, 1], [2, 0]]


def test_schedule_into_matches_and_validates_out():
    lens = make_lens(77, 2, 5000, "uniform", 3)
    out = torch.full((133, 2), -7, dtype=torch.int32)
    res = paged_mqa_schedule_into(out, lens, 64, 132, "new")
    assert res is out and torch.equal(out, reference_paged_mqa_schedule(lens, 64, 132, "new"))
    with pytest.raises(PlanError) as e:
        paged_mqa_schedule_into(torch.zeros(132, 2, dtype=torch.int32), lens, 64, 132)
    assert e.value.field == "out"
    with pytest.raises(PlanError) as e:
        paged_mqa_schedule_into(torch.zeros(133, 2, dtype=torch.int64), lens, 64, 132)
    assert e.value.field == "out"


def test_metadata_dispatch_on_cpu_is_the_reference():
    lens = make_lens(40, 1, 9000, "skewed", 5)
    assert torch.equal(
        get_paged_mqa_logits_metadata(lens, 64, 132), reference_paged_mqa_schedule(lens, 64, 132)
    )
    with pytest.raises(ProviderError) as e:
        get_paged_mqa_logits_metadata(lens, 64, 132, backend="native")
    assert e.value.field == "backend"


GOOD = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"context_lens": GOOD.long()}, "context_lens"),
        ({"context_lens": GOOD[:, 1]}, "context_lens"),  # 1-D is rejected like 0.1.0
        ({"context_lens": GOOD.t()}, "context_lens"),  # not contiguous
        ({"context_lens": torch.ones(2, 3, dtype=torch.int32)}, "context_lens"),  # next_n 3
        ({"context_lens": torch.ones(0, 1, dtype=torch.int32)}, "context_lens"),  # empty batch
        ({"context_lens": torch.tensor([[3, 0]], dtype=torch.int32)}, "context_lens"),
        ({"context_lens": torch.tensor([[0, 1]], dtype=torch.int32)}, "context_lens"),
        ({"context_lens": torch.zeros(4, 1, dtype=torch.int32)}, "context_lens"),
        ({"context_lens": torch.tensor([[-1, 4]], dtype=torch.int32)}, "context_lens"),
        ({"context_lens": torch.tensor([[9, 4]], dtype=torch.int32)}, "context_lens"),
        ({"context_lens": [[1]]}, "context_lens"),
        ({"block_kv": 32}, "block_kv"),
        ({"num_sms": 0}, "num_sms"),
        ({"num_sms": 1.5}, "num_sms"),
        ({"layout": "0.2.0"}, "layout"),
    ],
)
def test_schedule_validation(kwargs, field):
    args = {"context_lens": GOOD, "block_kv": 64, "num_sms": 8, "layout": "0.1.0"} | kwargs
    for fn in (reference_paged_mqa_schedule, get_paged_mqa_logits_metadata):
        with pytest.raises(PlanError) as e:
            if fn is get_paged_mqa_logits_metadata:
                layout = args.pop("layout")
                try:
                    fn(**args, layout=layout)
                finally:
                    args["layout"] = layout
            else:
                fn(**args)
        assert e.value.field == field


def test_unchecked_lengths_still_follow_the_kernel():
    """check_values=False (graph capture) computes what the kernel would, zeros included."""
    lens = torch.tensor([[0, 1], [99, 100], [5, 0]], dtype=torch.int32)
    for layout in ("0.1.0", "new"):
        got = reference_paged_mqa_schedule(lens, 64, 4, layout, check_values=False)
        assert [tuple(r) for r in got.tolist()] == kernel_port(lens.tolist(), 4, layout)
    zeros = torch.zeros(40, 1, dtype=torch.int32)  # total 0: every SM at the end (0.1.0)
    got = reference_paged_mqa_schedule(zeros, 64, 8, check_values=False)
    assert got.tolist() == [[40, 0]] * 9


def test_header_classifier():
    old = "uint32_t seg_starts = sm_idx * q + min(sm_idx, r);\n"
    new = "const uint32_t pivot = kNumSMs - r;\nuint32_t seg_starts = sm_idx * q + (sm_idx > pivot ? sm_idx - pivot : 0);\n"
    assert _native.classify_schedule_header(old * 2) == "0.1.0"
    assert _native.classify_schedule_header(old + new) == "new"  # the non-varlen branch is last
    assert _native.classify_schedule_header("nothing here") is None


def test_native_import_failure_is_remembered_and_warned_once(monkeypatch):
    calls = []

    def fail(name):
        calls.append(name)
        raise OSError("undefined symbol: _ZN3c10fake")

    monkeypatch.setattr(_native, "importlib", SimpleNamespace(import_module=fail))
    _native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="undefined symbol"):
            assert _native.load() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _native.load() is None and not _native.available()
        assert calls == ["deep_gemm"]
    finally:
        _native.reset()


def test_native_layout_is_read_from_the_shipped_header(monkeypatch, tmp_path):
    header = tmp_path / "include" / "deep_gemm" / "scheduler" / "paged_mqa_logits.cuh"
    header.parent.mkdir(parents=True)
    header.write_text("const uint32_t pivot = kNumSMs - r;\nseg_starts = sm_idx * q + pivot;\n")
    monkeypatch.setattr(_native, "_package_dir", lambda: str(tmp_path))
    _native.reset()
    try:
        assert _native.native_schedule_layout() == "new"
        monkeypatch.setattr(_native, "_package_dir", lambda: None)
        assert _native.native_schedule_layout() == "new"  # cached for the process
        _native.reset()
        assert _native.native_schedule_layout() is None
    finally:
        _native.reset()


# --------------------------------------------------------------------------- fp8


def test_quantize_scale_rule_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 4, 64).unsqueeze(1)
    x[3] = 0.0
    x_fp8, scale = quantize_fp8_e4m3_per_vector(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (64, 2)
    amax = x.reshape(64, 2, 128).abs().amax(-1).clamp(min=1e-4)
    log2 = torch.log2(scale)
    assert torch.equal(log2, log2.round())  # powers of two
    assert bool((amax / scale <= FP8_MAX).all()) and bool((amax / scale > FP8_MAX / 2).all())
    back = dequantize_fp8_per_vector(x_fp8, scale)
    s = scale.repeat_interleave(128, dim=1)
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10)  # 3 mantissa bits; subnormal spacing
    assert bool(((back - x).abs() <= bound).all())
    assert bool((back[3] == 0).all())


def test_quantize_exact_power_of_two_boundary():
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0 * 2.0**-3  # amax / 448 is exactly 2^-3: scale must be 2^-3, not 2^-2
    _, scale = quantize_fp8_e4m3_per_vector(x)
    assert scale.item() == 2.0**-3


def test_quantize_query_scales_per_head():
    q = torch.randn(3, 2, 4, 128)
    q_fp8, q_scale = quantize_query(q)
    assert q_fp8.shape == q.shape and q_scale.shape == (3, 2, 4)
    back = q_fp8.float() * q_scale.unsqueeze(-1)
    assert torch.allclose(back, q, rtol=2**-3, atol=1e-2)
    with pytest.raises(PlanError) as e:
        quantize_query(torch.randn(2, 64))
    assert e.value.field == "q"


def test_cache_pack_unpack_round_trip_and_byte_layout():
    d, nb = 128, 5
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(nb * PAGE, generator=g)[:100]
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(torch.randn(100, d, generator=g))
    cache = pack_index_kv_cache(k_fp8, k_scale, slots, nb)
    assert cache.shape == (nb, PAGE, 1, d + 4) and cache.dtype == torch.uint8
    keys, scales = unpack_index_kv_cache(cache)
    assert torch.equal(keys[slots].view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(scales[slots], k_scale[:, 0])
    # raw bytes: token t of block b at b*64*(D+4) + t*D, its scale at ... + 64*D + 4*t
    raw = cache.reshape(-1)
    n = int(slots[7])
    blk, off = divmod(n, PAGE)
    base = blk * PAGE * (d + 4)
    assert torch.equal(raw[base + off * d : base + (off + 1) * d], k_fp8[7].view(torch.uint8))
    sb = base + PAGE * d + 4 * off
    assert raw[sb : sb + 4].view(torch.float32).item() == k_scale[7, 0].item()


def test_cache_views_follow_a_strided_block_pool():
    pool = torch.zeros(6, PAGE, 1, 132, dtype=torch.uint8)
    cache = pool[::2]  # stride(0) is two blocks
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(torch.randn(3, 128))
    write_index_cache(cache, torch.tensor([0, 65, 191]), k_fp8, k_scale)
    assert int(pool[1].count_nonzero()) == 0 and int(pool[3].count_nonzero()) == 0
    keys, scales = index_cache_views(cache)
    assert torch.equal(keys[1, 1].view(torch.uint8), k_fp8[1].view(torch.uint8))
    assert scales[2, 63].item() == k_scale[2, 0].item()


@pytest.mark.parametrize("d", [128, 36, 18, 9])
@pytest.mark.parametrize("first", [0, 1])
def test_gather_moves_whole_words_and_equals_the_bytes(d, first):
    """The gather copies keys as 8/4/2/1-byte words, whichever the layout allows (a pool
    sliced from block ``first``, key widths of every alignment): the same bytes as a
    gather of single bytes."""
    nb = 4
    g = torch.Generator().manual_seed(d + first)
    pool = torch.randint(0, 256, (nb + 1, PAGE, 1, d + 4), dtype=torch.uint8, generator=g)
    cache = pool[first : first + nb]
    slots = torch.randint(0, nb * PAGE, (77,), generator=g, dtype=torch.int32)
    keys, scales = gather_index_cache(cache, slots)
    all_keys, all_scales = unpack_index_kv_cache(cache)
    assert keys.dtype == torch.float8_e4m3fn and keys.shape == (77, d)
    assert torch.equal(keys.view(torch.uint8), all_keys[slots.long()].view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), all_scales[slots.long()].view(torch.int32))


def test_cache_validation():
    with pytest.raises(PlanError) as e:
        index_cache_views(torch.zeros(2, 32, 1, 132, dtype=torch.uint8))
    assert e.value.field == "kv_cache"
    with pytest.raises(PlanError) as e:
        write_index_cache(new_index_cache(1), torch.tensor([0]), torch.zeros(1, 128), torch.ones(1))
    assert e.value.field == "k_fp8"


# --------------------------------------------------------------------------- logits


def make_logits_case(batch, next_n, heads, dim, lens_last, seed, extra_blocks=3):
    """Random fp8 q/keys in a shuffled page pool; returns everything the kernel takes."""
    g = torch.Generator().manual_seed(seed)
    lens_last = torch.as_tensor(lens_last)
    pages = [-(-int(n) // PAGE) for n in lens_last]
    nb = sum(pages) + extra_blocks
    perm = torch.randperm(nb, generator=g)
    max_pages = max(pages) + 1
    table = torch.randint(0, 2**30, (batch, max_pages), generator=g, dtype=torch.int64)
    cache = new_index_cache(nb, dim)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used : used + p]
        used += p
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(torch.randn(nb * PAGE, dim, generator=g))
    k_scale = k_scale * torch.rand(nb * PAGE, 1, generator=g)  # varied scales
    write_index_cache(cache, torch.arange(nb * PAGE), k_fp8, k_scale)
    q_fp8, _ = quantize_fp8_e4m3_per_vector(torch.randn(batch, next_n, heads, dim, generator=g))
    weights = torch.randn(batch * next_n, heads, generator=g)
    cols = [(lens_last - (next_n - 1 - i)).clamp(min=1) for i in range(next_n)]
    lens = torch.stack(cols, 1).to(torch.int32).contiguous()
    sched = reference_paged_mqa_schedule(lens, 64, 8)
    return q_fp8, cache, weights, lens, table.to(torch.int32), sched


def brute_force_logits(q_fp8, cache, weights, lens, table, width):
    keys, scales = unpack_index_kv_cache(cache)
    batch, next_n, heads, _ = q_fp8.shape
    out = torch.full((batch * next_n, width), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for i in range(next_n):
            n = min(int(lens[b, i]), width)
            if n == 0:
                continue
            slot = table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
            k = keys[slot].double()  # [n, D]
            dots = q_fp8[b, i].double() @ k.T  # [H, n]
            w = weights[b * next_n + i].double().unsqueeze(1)
            out[b * next_n + i, :n] = (dots.clamp(min=0) * w).sum(0) * scales[slot].double()
    return out


@pytest.mark.parametrize(
    ("batch", "next_n", "heads", "lens_last", "width"),
    [
        (1, 1, 32, [1], 64),
        (3, 1, 64, [70, 256, 1000], 1000),
        (4, 2, 32, [2, 65, 300, 4100], 4200),  # crosses the 4096-token chunk
        (2, 2, 16, [129, 40], 200),  # reference accepts any head count
        (2, 1, 8, [500, 50], 300),  # max_context_len shorter than a row
    ],
)
def test_logits_reference_matches_float64(batch, next_n, heads, lens_last, width):
    case = make_logits_case(batch, next_n, heads, 128, lens_last, seed=batch * 7 + next_n)
    q_fp8, cache, weights, lens, table, sched = case
    got = reference_fp8_paged_mqa_logits(*case, width)
    assert got.shape == (batch * next_n, width) and got.dtype == torch.float32
    assert got.stride(0) == -(-width // 256) * 256  # the kernel's padded row stride
    want = brute_force_logits(q_fp8, cache, weights, lens, table, width)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))  # -inf exactly at/past each row's length
    scale = want[finite].abs().max().clamp(min=1e-30)
    assert torch.allclose(got.double()[finite], want[finite], rtol=1e-5, atol=1e-6 * scale)
    assert torch.equal(fp8_paged_mqa_logits(*case, width), got)  # CPU dispatch = reference


def test_logits_mtp_rows_use_their_own_length():
    case = make_logits_case(2, 2, 32, 128, [300, 64], seed=11)
    got = reference_fp8_paged_mqa_logits(*case, 320)
    assert torch.isfinite(got[0, :299]).all() and torch.isinf(got[0, 299:]).all()  # row 0: 299
    assert torch.isfinite(got[1, :300]).all() and torch.isinf(got[1, 300:]).all()  # row 1: 300
    assert torch.isfinite(got[2, :63]).all() and torch.isinf(got[2, 63:]).all()


def test_logits_validation():
    case = list(make_logits_case(2, 1, 32, 128, [100, 200], seed=2))
    bad = {
        0: (case[0].float(), "q"),
        1: (case[1][:, :32], "kv_cache"),
        2: (case[2].t().contiguous().t(), "weights"),
        3: (case[3].view(-1), "context_lens"),
        4: (case[4].long(), "block_table"),
        5: (case[5][:, :1], "schedule_meta"),
    }
    for pos, (value, field) in bad.items():
        args = list(case)
        args[pos] = value
        with pytest.raises(PlanError) as e:
            reference_fp8_paged_mqa_logits(*args, 256)
        assert e.value.field == field, (pos, e.value)
    with pytest.raises(PlanError) as e:
        reference_fp8_paged_mqa_logits(*case, 256, True)
    assert e.value.field == "clean_logits"
    with pytest.raises(PlanError) as e:
        reference_fp8_paged_mqa_logits(*case, -1)
    assert e.value.field == "max_context_len"
    with pytest.raises(ProviderError):
        fp8_paged_mqa_logits(*case, 256, backend="native")


def test_logits_zero_width():
    case = make_logits_case(1, 1, 32, 128, [10], seed=4)
    assert reference_fp8_paged_mqa_logits(*case, 0).shape == (1, 0)


def test_units_formula():
    lens = torch.tensor([[1], [256], [257], [200_000]], dtype=torch.int32)
    assert schedule_units(lens).tolist() == [1, 1, 2, math.ceil(200_000 / 256)]
