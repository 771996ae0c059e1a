"""backends.deepgemm's drop-ins accept every call sgl-deep-gemm 0.1.0 accepts (CPU).

The signatures below are sgl-deep-gemm 0.1.0's Python wrappers, copied from
``deep_gemm/__init__.py`` in ``sgl_deep_gemm-0.1.0-py3-none-manylinux2014_x86_64.whl``
(the same file as tag v0.1.0 of github.com/sgl-project/DeepGEMM; the C++ behind them is
``csrc/apis/attention.hpp`` there). When that wheel is at hand (``.whl/`` of a checkout, or
``$SGL_DEEP_GEMM_WHEEL``), ``test_table_is_the_wheels`` re-reads it and checks the table.
The modes 0.1.0 added over the older API (varlen ``indices=``, bf16 logits, the
``fp8_fp4_*`` names) are checked against the references and an independent loop
transcription of the 0.1.0 metadata kernel.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import zipfile

import pytest
import torch

from backends import deepgemm
from backends.deepgemm import (
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
)
from benchmarks.verify.deepgemm import make_lens, make_logits_inputs
from benchmarks.verify.mqa_logits import make_inputs
from planner.errors import PlanError

REQUIRED = inspect.Parameter.empty
_PAGED = [
    ("q", REQUIRED),
    ("kv_cache", REQUIRED),
    ("weights", REQUIRED),
    ("context_lens", REQUIRED),
    ("block_table", REQUIRED),
    ("schedule_meta", REQUIRED),
    ("max_context_len", REQUIRED),
    ("clean_logits", False),
]
# sgl-deep-gemm 0.1.0, deep_gemm/__init__.py: (name, default) in order; none keyword-only.
SIGNATURES_010: dict[str, list[tuple[str, object]]] = {
    "get_paged_mqa_logits_metadata": [
        ("context_lens", REQUIRED),
        ("block_kv", REQUIRED),
        ("num_sms", REQUIRED),
        ("indices", None),
    ],
    "fp8_paged_mqa_logits": [*_PAGED, ("indices", None)],
    "fp8_mqa_logits": [
        ("q", REQUIRED),
        ("kv", REQUIRED),
        ("weights", REQUIRED),
        ("ks", REQUIRED),
        ("ke", REQUIRED),
        ("clean_logits", False),
        ("max_seqlen_k", 0),
    ],
    "fp8_fp4_paged_mqa_logits": [*_PAGED, ("logits_dtype", torch.float), ("indices", None)],
    "fp8_fp4_mqa_logits": [
        ("q", REQUIRED),
        ("kv", REQUIRED),
        ("weights", REQUIRED),
        ("cu_seq_len_k_start", REQUIRED),
        ("cu_seq_len_k_end", REQUIRED),
        ("clean_logits", False),
        ("max_seqlen_k", 0),
        ("logits_dtype", torch.float),
    ],
}
NAMES = sorted(SIGNATURES_010)


def _wheel() -> pathlib.Path | None:
    env = os.environ.get("SGL_DEEP_GEMM_WHEEL")
    if env:
        return pathlib.Path(env)
    root = pathlib.Path(__file__).resolve().parents[2] / ".whl"
    found = sorted(root.glob("sgl_deep_gemm-0.1.0-*.whl")) if root.is_dir() else []
    return found[0] if found else None


def test_table_is_the_wheels():
    wheel = _wheel()
    if wheel is None or not wheel.exists():
        pytest.skip("sgl_deep_gemm-0.1.0 wheel not here (scripts/fetch_gpu_wheels.sh)")
    with zipfile.ZipFile(wheel) as zf:
        tree = ast.parse(zf.read("deep_gemm/__init__.py"))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in SIGNATURES_010:
            a = node.args
            assert not a.kwonlyargs and a.vararg is None and a.kwarg is None, node.name
            defaults = [REQUIRED] * (len(a.args) - len(a.defaults)) + [
                ast.unparse(d) for d in a.defaults
            ]
            found[node.name] = [(p.arg, d) for p, d in zip(a.args, defaults)]

    def spelled(d: object) -> object:
        return d if d is REQUIRED else "torch.float" if d is torch.float else repr(d)

    for name, params in SIGNATURES_010.items():
        want = [(p, spelled(d)) for p, d in params]
        assert found.get(name) == want, name


@pytest.mark.parametrize("name", NAMES)
def test_exported_with_010s_parameters(name):
    """Same names, order and defaults; anything of ours comes after, keyword-only."""
    assert name in deepgemm.__all__
    params = list(inspect.signature(getattr(deepgemm, name)).parameters.values())
    table = SIGNATURES_010[name]
    head, extra = params[: len(table)], params[len(table) :]
    assert [(p.name, p.default) for p in head] == table
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in head)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert all(p.default is not REQUIRED for p in extra)


def _call_shapes(table: list[tuple[str, object]]):
    """Every way 0.1.0's signature binds: k positional, then the rest (or none) by keyword."""
    names = [n for n, _ in table]
    required = sum(d is REQUIRED for _, d in table)
    for k in range(len(names) + 1):
        for last in range(max(k, required), len(names) + 1):
            yield names[:k], names[k:last]


@pytest.mark.parametrize("name", NAMES)
def test_every_010_call_shape_binds(name):
    sig = inspect.signature(getattr(deepgemm, name))
    count = 0
    for positional, keywords in _call_shapes(SIGNATURES_010[name]):
        sig.bind(*positional, **{n: n for n in keywords})  # TypeError fails the test
        count += 1
    assert count > len(SIGNATURES_010[name])


# --- get_paged_mqa_logits_metadata(indices=): 0.1.0's varlen schedule ------------------------


def kernel_varlen_loop(lens: list[int], idx: list[int], num_sms: int) -> list[list[int]]:
    """A line-by-line transcription of the ``kIsVarlen`` branch of
    ``smxx_paged_mqa_logits_metadata`` (0.1.0's ``scheduler/paged_mqa_logits.cuh``)."""
    tokens, atoms, t = len(lens), [], 0
    while t < tokens:
        paired = t + 1 < tokens and idx[t] == idx[t + 1]
        atoms.append((t, lens[t + 1] if paired else lens[t]))
        t += 2 if paired else 1
    prefix, total = [], 0
    for _, length in atoms:
        total += -(-length // 256)
        prefix.append(total)
    q, r = divmod(total, num_sms)
    out = []
    for sm in range(num_sms + 1):
        seg = sm * q + min(sm, r)
        lo, hi = 0, len(atoms)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if prefix[mid] <= seg else (lo, mid)
        split = seg if lo == 0 else seg - prefix[lo - 1]
        out.append([atoms[lo][0] if lo < len(atoms) else tokens, split])
    return out


def varlen_case(tokens: int, seed: int, pair_rate: float, max_len: int = 5000):
    """Lengths [tokens, 1] and indices where runs of equal sequences have sorted lengths."""
    g = torch.Generator().manual_seed(seed)
    seq, idx = 0, []
    for _ in range(tokens):
        if idx and float(torch.rand(1, generator=g)) >= pair_rate:
            seq += 1
        idx.append(seq)
    lens = torch.randint(1, max_len + 1, (tokens,), generator=g)
    # tokens of one sequence are causal: lengths non-decreasing along a run
    order = torch.tensor(idx) * (max_len + 1) + lens
    lens = lens[order.argsort(stable=True)]
    return lens.to(torch.int32).unsqueeze(1).contiguous(), torch.tensor(idx, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(24))
def test_varlen_schedule_is_the_kernels(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = int(torch.randint(1, 300, (1,), generator=g))
    num_sms = int(torch.randint(1, 140, (1,), generator=g))
    lens, idx = varlen_case(tokens, seed, pair_rate=[0.0, 0.5, 0.9][seed % 3])
    want = torch.tensor(kernel_varlen_loop(lens[:, 0].tolist(), idx.tolist(), num_sms))
    got = get_paged_mqa_logits_metadata(lens, 64, num_sms, idx)  # positional, as 0.1.0 allows
    assert got.dtype == torch.int32 and tuple(got.shape) == (num_sms + 1, 2)
    assert torch.equal(got, want.to(torch.int32))
    assert torch.equal(reference_paged_mqa_schedule(lens, 64, num_sms, indices=idx), got)


def test_varlen_with_distinct_indices_is_the_plain_schedule():
    lens = make_lens(200, 1, 9000, "skewed", 3)
    idx = torch.arange(200, dtype=torch.int32)
    assert torch.equal(
        get_paged_mqa_logits_metadata(lens, 64, 132, indices=idx),
        get_paged_mqa_logits_metadata(lens, 64, 132),
    )


def test_varlen_pairs_change_the_schedule():
    lens, idx = varlen_case(64, 5, pair_rate=0.9)
    assert not torch.equal(
        get_paged_mqa_logits_metadata(lens, 64, 16, indices=idx),
        get_paged_mqa_logits_metadata(lens, 64, 16),
    )


LENS1 = torch.tensor([[5], [9], [7]], dtype=torch.int32)
IDX = torch.tensor([0, 0, 1], dtype=torch.int32)


@pytest.mark.parametrize(
    ("lens", "indices", "kwargs", "field"),
    [
        (LENS1, IDX.long(), {}, "indices"),
        (LENS1, IDX[:2], {}, "indices"),
        (LENS1, IDX.unsqueeze(1), {}, "indices"),
        (LENS1, torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)[::2], {}, "indices"),
        (LENS1, [0, 0, 1], {}, "indices"),
        (torch.ones(3, 2, dtype=torch.int32), IDX, {}, "indices"),  # next_n 2
        (LENS1, IDX, {"layout": "new"}, "indices"),
        (torch.tensor([[9], [5], [7]], dtype=torch.int32), IDX, {}, "context_lens"),
        (LENS1, IDX, {"block_kv": 32}, "block_kv"),
    ],
)
def test_varlen_refusals_name_the_argument(lens, indices, kwargs, field):
    args = {"context_lens": lens, "block_kv": 64, "num_sms": 8, "indices": indices} | kwargs
    with pytest.raises(PlanError) as e:
        get_paged_mqa_logits_metadata(**args)
    assert e.value.field == field


# --- fp8_paged_mqa_logits / fp8_fp4_paged_mqa_logits ------------------------------------------


def paged_case(batch: int = 6, next_n: int = 1, seed: int = 2, max_len: int = 700):
    lens = make_lens(batch, next_n, max_len, "uniform", seed)
    q, cache, w, lens, table = make_logits_inputs(batch, next_n, 4, lens, seed, torch.device("cpu"))
    sched = reference_paged_mqa_schedule(lens, 64, 8)
    return q, cache, w, lens, table, sched, int(lens.max()) + 3


def test_paged_logits_indices_distinct_is_plain():
    args = paged_case()
    idx = torch.arange(6, dtype=torch.int32)
    assert torch.equal(fp8_paged_mqa_logits(*args, False, idx), fp8_paged_mqa_logits(*args))


def test_paged_logits_pairs_read_the_first_tokens_block_row():
    q, cache, w, _, table, sched, width = paged_case()
    lens = torch.tensor([[100], [300], [50], [60], [200], [650]], dtype=torch.int32)
    idx = torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32)  # pairs (0,1), (2,3); 4, 5 alone
    sched = get_paged_mqa_logits_metadata(lens, 64, 8, idx)
    got = fp8_paged_mqa_logits(q, cache, w, lens, table, sched, width, False, idx)
    rows = torch.tensor([0, 0, 2, 2, 4, 5])
    want = reference_fp8_paged_mqa_logits(q, cache, w, lens, table[rows], sched, width)
    assert torch.equal(got, want)
    assert not torch.equal(
        got, reference_fp8_paged_mqa_logits(q, cache, w, lens, table, sched, width)
    )


@pytest.mark.parametrize("next_n", [1, 2])
def test_fp8_fp4_paged_float_is_fp8_paged(next_n):
    args = paged_case(next_n=next_n)
    plain = fp8_paged_mqa_logits(*args)
    got = fp8_fp4_paged_mqa_logits((args[0], None), *args[1:])
    assert got.dtype == torch.float32 and torch.equal(got, plain)
    assert torch.equal(fp8_fp4_paged_mqa_logits([args[0], None], *args[1:], False, "float"), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "torch.bfloat16"])
def test_paged_bf16_logits_round_the_fp32_ones(dtype):
    args = paged_case(next_n=2)
    plain = fp8_paged_mqa_logits(*args)
    got = fp8_fp4_paged_mqa_logits((args[0], None), *args[1:], logits_dtype=dtype)
    assert got.dtype == torch.bfloat16 and got.shape == plain.shape
    assert got.stride() == plain.stride()  # 0.1.0: the same element stride for both dtypes
    assert torch.equal(got, plain.to(torch.bfloat16))
    assert bool(torch.isneginf(got).any())  # -inf survives the cast


def test_paged_varlen_bf16_together():
    q, cache, w, _, table, _, width = paged_case()
    lens = torch.tensor([[100], [300], [50], [60], [200], [650]], dtype=torch.int32)
    idx = torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32)
    sched = get_paged_mqa_logits_metadata(lens, 64, 8, idx)
    args = (cache, w, lens, table, sched, width)
    got = fp8_fp4_paged_mqa_logits((q, None), *args, False, torch.bfloat16, idx)
    assert torch.equal(got, fp8_paged_mqa_logits(q, *args, False, idx).to(torch.bfloat16))


def _fp4_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.zeros(*q.shape[:-1], q.shape[-1] // 2, dtype=torch.uint8)
    if hasattr(torch, "float4_e2m1fn_x2"):
        packed = packed.view(torch.float4_e2m1fn_x2)
    return packed, torch.zeros(q.shape[:-1], dtype=torch.int32)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda a: {"q": a["q"][0]}, "q", "pair"),  # a bare tensor: 0.1.0 raises TypeError
        (lambda a: {"q": _fp4_q(a["q"][0])}, "q", "not supported by the reference: argument `q`"),
        (lambda a: {"logits_dtype": torch.float16}, "logits_dtype", "bfloat16"),
        (lambda a: {"logits_dtype": "int32"}, "logits_dtype", "bfloat16"),
        (lambda a: {"clean_logits": True}, "clean_logits", "clean_logits"),
    ],
)
def test_fp8_fp4_paged_refusals_name_the_argument(change, field, words):
    q, *rest = paged_case()
    names = [n for n, _ in SIGNATURES_010["fp8_fp4_paged_mqa_logits"]][1:7]
    a = {"q": (q, None)} | dict(zip(names, rest))
    with pytest.raises(PlanError) as e:
        fp8_fp4_paged_mqa_logits(**(a | change(a)))
    assert e.value.field == field and words in str(e.value)


# --- fp8_mqa_logits / fp8_fp4_mqa_logits ------------------------------------------------------


def ragged_case(seed: int = 3):
    case = dict(tokens=9, kv_tokens=300, heads=4, kind="causal", seed=seed, extra_width=0)
    inp = make_inputs(case, torch.device("cpu"))
    return inp["q"], inp["kv"], inp["weights"], inp["ks"], inp["ke"]


@pytest.mark.parametrize(("clean", "width"), [(False, 0), (True, 0), (False, 400)])
def test_fp8_fp4_mqa_float_is_fp8_mqa(clean, width):
    q, kv, w, ks, ke = ragged_case()
    plain = fp8_mqa_logits(q, kv, w, ks, ke, clean, width)
    got = fp8_fp4_mqa_logits(
        (q, None), kv, w, cu_seq_len_k_start=ks, cu_seq_len_k_end=ke, clean_logits=clean,
        max_seqlen_k=width,
    )  # fmt: skip
    assert got.dtype == torch.float32 and torch.equal(got, plain)
    assert got.stride() == plain.stride()


@pytest.mark.parametrize(("clean", "width"), [(False, 0), (True, 0), (False, 400)])
def test_mqa_bf16_logits_round_the_fp32_ones(clean, width):
    q, kv, w, ks, ke = ragged_case()
    plain = fp8_mqa_logits(q, kv, w, ks, ke, clean, width)
    got = fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean, width, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.stride() == plain.stride()
    assert torch.equal(got, plain.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda a: {"q": a["q"][0]}, "q"),
        (lambda a: {"q": _fp4_q(a["q"][0])}, "q"),
        (lambda a: {"logits_dtype": torch.float64}, "logits_dtype"),
        (lambda a: {"kv": a["kv"][0]}, "kv"),  # 0.1.0 needs the (k, k_scale) pair too
        (lambda a: {"clean_logits": True, "max_seqlen_k": 400}, "clean_logits"),
    ],
)
def test_fp8_fp4_mqa_refusals_name_the_argument(change, field):
    q, kv, w, ks, ke = ragged_case()
    a = dict(q=(q, None), kv=kv, weights=w, cu_seq_len_k_start=ks, cu_seq_len_k_end=ke)
    with pytest.raises(PlanError) as e:
        fp8_fp4_mqa_logits(**(a | change(a)))
    assert e.value.field == field


def test_every_drop_in_runs_with_all_010_arguments_positional():
    """One real call per function with every 0.1.0 argument given, positionally."""
    q, cache, w, lens, table, sched, width = paged_case()
    idx = torch.arange(6, dtype=torch.int32)
    assert get_paged_mqa_logits_metadata(lens, 64, 8, None).shape == (9, 2)
    assert get_paged_mqa_logits_metadata(lens, 64, 8, idx).shape == (9, 2)
    paged = (q, cache, w, lens, table, sched, width, False)
    assert fp8_paged_mqa_logits(*paged, idx).shape == (6, width)
    assert fp8_fp4_paged_mqa_logits((q, None), *paged[1:], torch.float, idx).shape == (6, width)
    rq, kv, rw, ks, ke = ragged_case()
    assert fp8_mqa_logits(rq, list(kv), rw, ks, ke, True, 0).shape == (9, kv[0].shape[0])
    assert fp8_fp4_mqa_logits((rq, None), kv, rw, ks, ke, False, 512, torch.float).shape == (9, 512)
