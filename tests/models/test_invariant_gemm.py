"""The batch-invariant mode on the CPU: its GEMM kernel under Triton's interpreter, the gate
reference's tie rule, the fixed-order MoE combine, and the mode's reach.

The kernel (``invariant_gemm``): a row's output is the same bits alone (M = 1) and at any
position inside batches of 4, 17 and 64 rows (one tile, more than one tile, a full tile),
batched over groups (the MLA heads, through strided views) too, and within a tolerance of
the float64 reference rounded once. The interpreter multiplies in numpy, so this holds the
kernel's indexing, masks and tile walk; the compiled numerics are checked on the GPU
(``tests/gpu/test_invariant_gemm_gpu.py``).

The mode's reach: with the kernel route forced on CPU tensors and the GEMM replaced by a
recorder, a forward of the tiny model (and of its MTP draft) sends every GEMM site through
the kernel, and none with the mode off; with the mode on but no CUDA the CPU model's
outputs are bit-for-bit the default ones.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers import exact, grouped_gemm, invariant_gemm
from dsv32_engine.models.layers.exact import Linear
from dsv32_engine.models.layers.ffn import MLP, Gate, MoE
from dsv32_engine.models.layers.grouped_gemm_triton import INVARIANT_TILE_ROWS, grouped_mm_triton
from dsv32_engine.models.layers.indexer import Indexer
from dsv32_engine.models.layers.invariant_gemm import (
    TileConfig,
    invariant_contract,
    invariant_linear,
    invariant_mm,
    invariant_mm_reference,
    linear_reference,
    tile_config,
)
from dsv32_engine.models.layers.mla import MLA
from dsv32_engine.models.layers.moe_gate_triton import route_reference, select_experts
from dsv32_engine.models.layers.moe_routing import combine, sort_by_expert_torch
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import MTPDraft
from tests.models.test_model import Session
from tests.support.kernels import interpretable_stdlib

BATCHES = (4, 17, 64)
DTYPES = (torch.bfloat16, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _positions(m: int) -> list[int]:
    return sorted({0, m // 2, m - 1})


def _host_blas_rows_independent(rows: int, k: int, n: int) -> bool:
    """Whether numpy's float32 matmul of a ``rows``-row tile gives a row the same bits at
    every position. The interpreter multiplies tiles with it, and OpenBLAS's micro-kernels
    on some CPUs do not (this 2-core AMD EPYC VM's: rows 6 and up are summed in another
    order than rows 0-5), so there the interpreter cannot show a row's bits are the same
    at any offset inside a tile; only the compiled kernel can (the GPU test)."""
    rng = np.random.default_rng(0)
    b = rng.standard_normal((k, n)).astype(np.float32)
    row = rng.standard_normal(k).astype(np.float32)
    alone = np.zeros((rows, k), np.float32)
    alone[0] = row
    want = np.matmul(alone, b)[0]
    for pos in range(rows):
        tile = rng.standard_normal((rows, k)).astype(np.float32)
        tile[pos] = row
        if not np.array_equal(np.matmul(tile, b)[pos], want):
            return False
    return True


def _batch_with(row: torch.Tensor, m: int, pos: int, gen: torch.Generator) -> torch.Tensor:
    """``m`` random rows with ``row`` at ``pos``."""
    batch = torch.randn(m, row.shape[-1], generator=gen).to(row.dtype)
    batch[pos] = row
    return batch


# ------------------------------------------------------------------- the kernel


@pytest.mark.triton
@interpretable_stdlib
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_row_is_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 72  # neither a multiple of the tiles: masked columns and K steps
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = invariant_linear(row, weight, bias)
    assert alone.dtype == dtype and alone.shape == (1, n)
    tile_rows, block_n, block_k = tile_config(n, k, 1, ieee=dtype == torch.float32)[:3]
    # Where the host's BLAS sums a row by its offset in the tile (see the probe), the bits
    # are held at the tiles' first rows only.
    any_offset = _host_blas_rows_independent(tile_rows, block_k, block_n)
    for m in BATCHES:
        starts = range(0, m, tile_rows)
        for pos in sorted(set(_positions(m)) | set(starts)):
            batch = _batch_with(row[0], m, pos, gen)
            out = invariant_linear(batch, weight, bias)
            if any_offset or pos % tile_rows == 0:
                assert torch.equal(_bits(out[pos : pos + 1]), _bits(alone)), (m, pos)
            ref = linear_reference(batch, weight, bias)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.triton
@interpretable_stdlib
def test_mixed_dtypes_widen_to_fp32_as_the_indexer_head_weights() -> None:
    """bf16 activations against an fp32 weight, fp32 out: ``weights_proj`` in the mode."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 96, generator=gen) / 10
    row = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    alone = invariant_linear(row, weight, out_dtype=torch.float32)
    for m in BATCHES:
        batch = _batch_with(row[0], m, m - 1, gen)
        out = invariant_linear(batch, weight, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        assert torch.equal(out[m - 1 :], alone)
        ref = linear_reference(batch, weight, out_dtype=torch.float32)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.triton
@interpretable_stdlib
@pytest.mark.parametrize("equation", ["rhd,hdc->rhc", "rhc,hdc->rhd"])
def test_batched_head_contractions_are_row_invariant(equation: str) -> None:
    """The MLA absorb and output einsums: one GEMM per head over strided views."""
    gen = torch.Generator().manual_seed(2)
    heads, nope, v, c = 3, 16, 24, 40
    wkv_b = (torch.randn(heads, nope + v, c, generator=gen) / 6).to(torch.bfloat16)
    w = wkv_b[:, :nope] if equation == "rhd,hdc->rhc" else wkv_b[:, nope:]
    width = nope if equation == "rhd,hdc->rhc" else c
    # An activation view with a row stride wider than its heads (as q_nope's in q).
    row = torch.randn(1, heads, width + 8, generator=gen).to(torch.bfloat16)[..., :width]
    alone = invariant_contract(equation, row, w, torch.bfloat16)
    for m in BATCHES:
        for pos in _positions(m):
            batch = torch.randn(m, heads, width + 8, generator=gen).to(torch.bfloat16)
            batch[pos] = torch.nn.functional.pad(row[0], (0, 8))
            x = batch[..., :width]
            out = invariant_contract(equation, x, w, torch.bfloat16)
            assert torch.equal(_bits(out[pos : pos + 1]), _bits(alone)), (m, pos)
            ref = torch.einsum(equation, x.double(), w.double()).to(torch.bfloat16)
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.triton
@interpretable_stdlib
def test_gate_contraction_and_unknown_equations() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=gen)
    w = torch.randn(12, 32, generator=gen)
    out = invariant_contract("rd,ed->re", x, w, torch.float32)
    torch.testing.assert_close(out, linear_reference(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no batch-invariant kernel"):
        invariant_contract("erd,eid->eri", x, w, torch.float32)


@pytest.mark.triton
@interpretable_stdlib
def test_empty_batch_and_reference() -> None:
    w = torch.randn(4, 16)
    assert invariant_linear(torch.empty(0, 16), w).shape == (0, 4)
    a, b = torch.randn(2, 3, 16), torch.randn(2, 16, 5)
    torch.testing.assert_close(
        invariant_mm(a, b), invariant_mm_reference(a, b), rtol=1e-5, atol=1e-5
    )


def test_tile_config_depends_on_the_weight_only() -> None:
    """No ``M`` in its inputs; the shapes the model uses get enough column tiles."""
    assert list(inspect.signature(tile_config).parameters) == ["n", "k", "groups", "ieee"]
    assert tile_config(129280, 7168, 1, False) == (64, 128, 64, 4, 4, 1)  # the LM head
    assert tile_config(2240, 7168, 1, False).splits == 8  # wq_a | wkv_a | wk: 18 x 8 tiles
    assert tile_config(7168, 16384, 1, False).splits == 4  # wo: 56 x 4
    assert tile_config(24576, 1536, 1, False).splits == 1  # wq_b: 192 column tiles
    assert tile_config(512, 128, 128, False)[1:] == (128, 64, 4, 4, 1)  # absorb, 128 heads
    assert tile_config(64, 7168, 1, True) == (16, 16, 32, 4, 3, 16)  # weights_proj, fp32
    assert tile_config(64, 96, 1, True).splits == 1  # too short a K to split


@pytest.mark.triton
@interpretable_stdlib
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_rows_are_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """A weight cut along K (a decode GEMM with few column tiles): the partials are added
    in split order, then the bias, so a row's bits still ignore its batch; the sum stays
    close to the float64 reference, and to the unsplit kernel."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 40 * 32 + 8  # K not a multiple of the split
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    ieee = dtype == torch.float32
    config = tile_config(n, k, 1, ieee)
    assert config.splits > 1  # the shape really splits
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = invariant_linear(row, weight, bias)
    for m in BATCHES:
        pos = m - 1
        batch = _batch_with(row[0], m, pos, gen)
        out = invariant_linear(batch, weight, bias)
        assert torch.equal(_bits(out[pos : pos + 1]), _bits(alone)), m
        ref = linear_reference(batch, weight, bias)
        tol = 1e-5 if ieee else 1e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        whole = invariant_mm(batch, weight.t(), bias=bias, config=TileConfig(*config[:5]))
        torch.testing.assert_close(out.float(), whole.float(), rtol=tol, atol=tol)


# ------------------------------------------------------------- MoE pieces


@pytest.mark.triton
@interpretable_stdlib
def test_grouped_mm_with_fixed_tile_rows_is_row_invariant() -> None:
    gen = torch.Generator().manual_seed(4)
    groups, k, n = 4, 40, 24
    b = (torch.randn(groups, n, k, generator=gen) / 6).to(torch.bfloat16).transpose(1, 2)
    row = torch.randn(k, generator=gen).to(torch.bfloat16)
    outs = []
    for m in (1, 5, 40):  # the row is the last of group 2; other groups' sizes vary
        sizes = [m // 3, m // 3, m - 2 * (m // 3), 0] if m > 1 else [0, 0, 1, 0]
        ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        a[int(ends[2]) - 1] = row
        y = grouped_mm_triton(a, b, ends, block_rows=INVARIANT_TILE_ROWS)
        outs.append(y[int(ends[2]) - 1])
        ref = grouped_gemm.reference_grouped_mm(a, b, ends)
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs)


def test_combine_in_order_adds_the_slots_one_by_one() -> None:
    gen = torch.Generator().manual_seed(5)
    rows, top_k, dim, experts = 6, 3, 8, 5
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=gen)
    batch = sort_by_expert_torch(weights, indices, experts)
    y = torch.randn(rows * top_k, dim, generator=gen)
    out = combine(y, batch, rows, top_k, in_order=True)
    pairs = torch.empty_like(y).index_copy_(0, batch.order, y * batch.weights[:, None])
    slots = pairs.view(rows, top_k, dim)
    assert torch.equal(out, (slots[:, 0] + slots[:, 1]) + slots[:, 2])
    torch.testing.assert_close(out, combine(y, batch, rows, top_k), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------- gate reference ties


def test_gate_reference_breaks_ties_lowest_id_first() -> None:
    rows, experts = 3, 16
    scores = torch.full((rows, experts), 0.5)
    bias = torch.zeros(experts)
    w, idx = select_experts(scores, bias, 4, 1, 1, 1.0)
    assert idx.tolist() == [[0, 1, 2, 3]] * rows
    torch.testing.assert_close(w, torch.full((rows, 4), 0.25))
    # Groups: all tied, the two lowest groups stay, then their lowest experts.
    _, idx = select_experts(scores, bias, 6, 4, 2, 1.0)
    assert idx.tolist() == [[0, 1, 2, 3, 4, 5]] * rows
    # A tie below a clear winner: the winner first, then the lowest of the tied.
    scores[:, 9] = 0.9
    _, idx = select_experts(scores, bias, 3, 1, 1, 1.0)
    assert idx.tolist() == [[9, 0, 1]] * rows
    # Through the logits path (float64 sigmoid), all-equal logits.
    _, idx = route_reference(torch.zeros(2, experts), bias, 5, 4, 3, 2.5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 2


def test_gate_reference_equals_topk_without_ties() -> None:
    gen = torch.Generator().manual_seed(6)
    scores = torch.rand(64, 32, generator=gen)
    bias = torch.rand(32, generator=gen) / 10
    weights, idx = select_experts(scores, bias, 4, 4, 2, 2.5)
    # topk's formulation (the previous reference), on values without ties.
    biased = (scores + bias).unflatten(-1, (4, -1))
    kept = biased.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    mask = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, kept, True)
    masked = biased.masked_fill(~mask[..., None], float("-inf")).flatten(-2)
    expected = masked.topk(4, dim=-1).indices
    assert torch.equal(idx, expected)
    chosen = scores.gather(1, expected)
    assert torch.equal(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)


# ---------------------------------------------------------------- the mode's reach

CFG = DSV32Config.tiny()


@pytest.fixture(scope="module")
def model() -> DSV32Model:
    """The tiny model with every fusion a CUDA model has (``FusedWeights`` on the CPU)."""
    m = DSV32Model(CFG, device="cpu", dtype=torch.float32)
    for block in m.layers:
        block.fuse_projections()
    return m


def _expected_modules(root: torch.nn.Module) -> set[str]:
    kinds = (Linear, MLA, exact.Linear, Indexer, MLP, Gate, MoE, DSV32Model, MTPDraft)
    return {name for name, mod in root.named_modules() if isinstance(mod, kinds)}


def test_set_batch_invariant_reaches_every_gemm_module(model: DSV32Model) -> None:
    assert not any(getattr(m, "batch_invariant", False) for m in model.modules())
    names = model.set_batch_invariant(True)
    try:
        assert set(names) == _expected_modules(model)
        for name in [
            "",
            "head",
            "layers.0.attn",
            "layers.0.attn.wq_a",
            "layers.0.attn.wq_b",
            "layers.0.attn.wkv_a",
            "layers.0.attn.wkv_b",
            "layers.0.attn.wo",
            "layers.0.attn.indexer",
            "layers.0.attn.indexer.wq_b",
            "layers.0.attn.indexer.wk",
            "layers.0.attn.indexer.weights_proj",
            "layers.0.ffn",
            "layers.0.ffn.w1",
            "layers.0.ffn.w2",
            "layers.0.ffn.w3",
            "layers.1.ffn",
            "layers.1.ffn.gate",
            "layers.1.ffn.shared",
            "layers.1.ffn.shared.w1",
            "layers.1.ffn.shared.w2",
            "layers.1.ffn.shared.w3",
        ]:
            assert model.get_submodule(name).batch_invariant is True, name
        # A second model in the same process keeps its own mode.
        other = DSV32Model(CFG, device="meta", dtype=torch.float32)
        assert not any(getattr(m, "batch_invariant", False) for m in other.modules())
    finally:
        assert set(model.set_batch_invariant(False)) == _expected_modules(model)
    assert not any(getattr(m, "batch_invariant", False) for m in model.modules())


class _Recorder:
    """Stands in for ``invariant_mm`` and the fixed-tile grouped GEMM: records each call's
    ``(groups, K, N)`` and computes the float64 reference."""

    def __init__(self) -> None:
        self.mm: list[tuple[int, int, int]] = []
        self.grouped: list[int | None] = []

    def invariant_mm(self, a, b, *, bias=None, out_dtype=None, out=None):
        flat = a.dim() == 2
        g = 1 if flat else a.shape[0]
        self.mm.append((g, a.shape[-1], b.shape[-1]))
        y = invariant_mm_reference(a, b, bias=bias, out_dtype=out_dtype)
        if out is None:
            return y
        out.copy_(y)
        return out

    def grouped_mm_triton(self, a, b, ends, *, block_rows=None):
        self.grouped.append(block_rows)
        return grouped_gemm.grouped_mm_loop(a, b, ends)


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(exact, "_kernel_route", lambda *tensors: True)
    monkeypatch.setattr(invariant_gemm, "invariant_mm", rec.invariant_mm)
    monkeypatch.setattr(grouped_gemm, "grouped_mm_triton", rec.grouped_mm_triton)
    return rec


def _decode(model: DSV32Model, rows: int = 3) -> torch.Tensor:
    s = Session(model)
    reqs = [s.add() for _ in range(rows)]
    logits, _ = s.step(reqs, [1] * rows, list(range(5, 5 + rows)))
    return logits


def _site_shapes(cfg: DSV32Config) -> set[tuple[int, int, int]]:
    """``(groups, K, N)`` of every GEMM site of the tiny model's forward."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    return {
        (1, d, cfg.q_lora_rank + cfg.kv_cache_dim + cfg.index_head_dim),  # fused wq_a|wkv_a|wk
        (1, cfg.q_lora_rank, h * cfg.qk_head_dim),  # wq_b
        (1, cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim),  # indexer wq_b
        (1, d, cfg.index_n_heads),  # indexer weights_proj
        (h, cfg.qk_nope_head_dim, cfg.kv_lora_rank),  # absorb
        (h, cfg.kv_lora_rank, cfg.v_head_dim),  # value up-projection
        (1, h * cfg.v_head_dim, d),  # wo
        (1, d, 2 * cfg.intermediate_size),  # dense MLP w1|w3
        (1, cfg.intermediate_size, d),  # dense MLP w2
        (1, d, cfg.n_routed_experts),  # gate
        (1, d, 2 * cfg.n_shared_experts * cfg.moe_intermediate_size),  # shared w1|w3
        (1, cfg.n_shared_experts * cfg.moe_intermediate_size, d),  # shared w2
        (1, d, cfg.vocab_size),  # LM head
    }


def test_every_gemm_site_routes_through_the_kernel_in_the_mode(
    model: DSV32Model, recorder: _Recorder
) -> None:
    _decode(model)
    assert not recorder.mm and not recorder.grouped  # the default path never routes
    model.set_batch_invariant(True)
    try:
        _decode(model)
    finally:
        model.set_batch_invariant(False)
    assert set(recorder.mm) == _site_shapes(CFG)
    moe_layers = sum(isinstance(b.ffn, MoE) for b in model.layers)
    assert recorder.grouped == [INVARIANT_TILE_ROWS] * 3 * moe_layers


def test_mtp_draft_routes_its_gemms_and_the_shared_head(
    model: DSV32Model, recorder: _Recorder
) -> None:
    draft = MTPDraft(model, seed=1)
    names = draft.set_batch_invariant(True)
    assert "eh_proj" in names and "block.attn" in names and "" in names
    assert not model.head.batch_invariant  # the target's own mode is untouched
    hidden = torch.randn(1, CFG.hidden_size)
    draft._next(hidden)
    assert recorder.mm == [(1, CFG.hidden_size, CFG.vocab_size)]
    draft.eh_proj(torch.randn(2, 2 * CFG.hidden_size))
    assert recorder.mm[-1] == (1, 2 * CFG.hidden_size, CFG.hidden_size)
    draft.set_batch_invariant(False)
    draft._next(hidden)
    assert len(recorder.mm) == 2


def test_the_mode_changes_nothing_off_cuda(model: DSV32Model) -> None:
    """The CPU model is invariant already: in the mode its logits are the default's bits."""
    default = _decode(model, rows=4)
    model.set_batch_invariant(True)
    try:
        invariant = _decode(model, rows=4)
    finally:
        model.set_batch_invariant(False)
    assert torch.equal(default, invariant)
