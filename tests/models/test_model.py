"""DeepSeek-V3.2 model: config, layers against independent formulas, whole-model decode.

Plans are built here by a small helper from ``seq_lens`` and ``req_to_token``
(the planner does this in production); the model must only read them.
"""

from __future__ import annotations

import json
import math
import random
import traceback
import types
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from backends.deepgemm import PAGE  # noqa: E402
from backends.paged import PagedPlan
from dsv32_engine.models.config import DSV32Config, YarnScaling
from dsv32_engine.models.hf_config import from_hf_config_json
from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.models.layers.ffn import MLP, Gate, MoE
from dsv32_engine.models.layers.hadamard import hadamard_matrix, hadamard_rotate
from dsv32_engine.models.layers.indexer import Indexer
from dsv32_engine.models.layers.mla import MLA
from dsv32_engine.models.layers.norm import LayerNorm, RMSNorm
from dsv32_engine.models.layers.rope import (
    apply_rope_half,
    apply_rope_interleaved,
    rope_cos_sin,
    yarn_inv_freq,
)
from dsv32_engine.models.model import Block, DSV32Model
from planner import Limits, Planner
from planner.errors import ConfigError, PlanError, SchemaError
from tests.support import REPO
from tests.support.engines import tiny_model
from tests.support.planners import PlannerSetup

ROOT = str(REPO)


# --------------------------------------------------------------------- helpers


def make_plan(
    pool: RequestPool, req_idx: list[int], seq_lens: list[int], topk: int, next_n: int = 1
) -> types.SimpleNamespace:
    """An NSA decode plan with the contract's fields, computed the slow obvious way."""
    from backends.deepgemm import reference_paged_mqa_schedule

    reqs, rows = len(seq_lens), len(seq_lens) * next_n
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    kv_lens = torch.stack([sl - next_n + i + 1 for i in range(next_n)], 1).flatten()
    kv_lens = kv_lens.to(torch.int32)
    positions = kv_lens - 1
    ridx = torch.tensor(req_idx, dtype=torch.int64)
    r2t = pool.req_to_token
    out_loc = r2t[ridx.repeat_interleave(next_n), positions.long()].to(torch.int32)
    max_len = int(sl.max())
    token_slots = r2t[ridx, :max_len].clone()
    page_table = torch.zeros(reqs, -(-max_len // PAGE), dtype=torch.int32)
    page_table.copy_(token_slots[:, ::PAGE] // PAGE)
    zero = torch.zeros(1, dtype=torch.int32)
    return types.SimpleNamespace(
        seq_lens=sl,
        positions=positions,
        out_cache_loc=out_loc,
        kv_lens=kv_lens,
        cu_seqlens_q=torch.arange(0, rows + 1, next_n, dtype=torch.int32),
        cu_seqlens_k=torch.cat([zero, sl.cumsum(0).to(torch.int32)]),
        token_slots=token_slots,
        page_table=page_table,
        kernel_page_table=page_table,
        topk_lens=kv_lens.clamp(max=topk),
        schedule=reference_paged_mqa_schedule(kv_lens.view(reqs, next_n), num_sms=8),
        next_n=next_n,
        kernel_next_n=next_n,
        topk=topk,
        mla_kernel="torch",  # the reference attention: these plans carry no split table
        max_seq_len=max_len,
    )


class Session:
    """Requests with their pages and tokens over one cache: the scheduler's job, minimal."""

    def __init__(self, model: DSV32Model, pages: int = 32, max_context: int = 512) -> None:
        self.model = model
        self.cache = model.new_cache(pages)
        self.pool = RequestPool(8, max_context, page_size=PAGE)
        self.pages: dict[int, list[int]] = {}

    def add(self) -> int:
        idx = self.pool.alloc()
        self.pages[idx] = []
        return idx

    def step(self, reqs: list[int], lens: list[int], ids: list[int], next_n: int = 1):
        """One forward: ``lens`` are KV lengths including this step's ``next_n`` tokens."""
        for r, n in zip(reqs, lens, strict=True):
            if r == 0:  # the null request (padding): its row stays all zeros
                continue
            while len(self.pages[r]) * PAGE < n:
                self.pages[r] += self.cache.alloc(1)
            self.pool.assign(r, self.pages[r], n)
        plan = make_plan(self.pool, reqs, lens, self.model.config.index_topk, next_n)
        logits = self.model(torch.tensor(ids), {"nsa": plan}, self.cache)
        return logits, plan


def tiny(**update) -> DSV32Config:
    return DSV32Config(**{**DSV32Config.tiny().model_dump(), **update})


def greedy(model: DSV32Model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Feed prompts token by token, then decode ``steps`` tokens greedily, all in one batch."""
    s = Session(model)
    reqs = [s.add() for _ in prompts]
    seqs = [list(p) for p in prompts]
    fed = [0] * len(prompts)
    while any(len(q) - len(p) < steps for q, p in zip(seqs, prompts, strict=True)):
        live = [
            i for i, (q, p) in enumerate(zip(seqs, prompts, strict=True)) if len(q) - len(p) < steps
        ]
        ids = [seqs[i][fed[i]] for i in live]
        logits, _ = s.step([reqs[i] for i in live], [fed[i] + 1 for i in live], ids)
        for row, i in enumerate(live):
            fed[i] += 1
            if fed[i] >= len(prompts[i]):
                seqs[i].append(int(logits[row].argmax()))
    return [q[len(p) :] for q, p in zip(seqs, prompts, strict=True)]


@pytest.fixture(scope="module")
def model() -> DSV32Model:
    return tiny_model()  # shared with the engine tests; layers only read it


# ---------------------------------------------------------------------- config


def test_presets_validate_and_counts_match_arithmetic() -> None:
    for name in ("small", "shapes"):
        cfg = getattr(DSV32Config, name)()
        assert cfg.kernel_issues() == []
        assert DSV32Model(cfg, device="meta").param_count() == cfg.param_count()
    full = DSV32Config.full()  # validated only, never instantiated
    assert full.kernel_issues() == []
    assert 671e9 < full.param_count() < 672e9
    assert DSV32Config.shapes().num_hidden_layers == 61
    assert DSV32Config.shapes().moe_stand_in_dim is not None
    assert math.isclose(full.softmax_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_preset_by_name() -> None:
    assert DSV32Config.preset("small") == DSV32Config.small()
    with pytest.raises(ConfigError) as e:
        DSV32Config.preset("huge")
    assert e.value.field == "preset" and "tiny" in str(e.value)


def test_tiny_model_param_count(model: DSV32Model) -> None:
    assert model.param_count() == model.config.param_count()


@pytest.mark.parametrize(
    ("update", "field", "words"),
    [
        ({"index_head_dim": 96}, "index_head_dim", "power of 2"),
        ({"index_topk": 0}, "index_topk", "greater than or equal to 1"),
        ({"num_attention_heads": 0}, "num_attention_heads", "greater than or equal to 1"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim", "even"),
        ({"topk_group": 5}, "topk_group", "<= n_group"),
        ({"n_routed_experts": 10}, "n_routed_experts", "multiple of n_group"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace", "<= num_hidden_layers"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok", "kept groups"),
        ({"page_size": 32}, "page_size", "64"),
        ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_field_and_limit(update: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        tiny(**update)
    assert field in str(e.value) and words in str(e.value)


def test_config_is_frozen_and_roundtrips_json() -> None:
    cfg = DSV32Config.tiny()
    with pytest.raises(ValidationError):
        cfg.hidden_size = 3  # type: ignore[misc]
    assert DSV32Config.model_validate_json(cfg.model_dump_json()) == cfg
    with pytest.raises(ValidationError, match="beta_fast"):
        YarnScaling(beta_fast=1.0, beta_slow=2.0)


HF_SAMPLE = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"fmt": "e4m3", "quant_method": "fp8"},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_from_hf_config_json(tmp_path: Path) -> None:
    assert from_hf_config_json(_write(tmp_path, HF_SAMPLE)) == DSV32Config.full()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"index_head_dim": 100}, "index_head_dim"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
        ({"rope_scaling": {**HF_SAMPLE["rope_scaling"], "factor": 0.5}}, "rope_scaling.factor"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_from_hf_config_json_errors(tmp_path: Path, change: dict, field: str) -> None:
    data = {k: v for k, v in {**HF_SAMPLE, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        from_hf_config_json(_write(tmp_path, data))
    assert e.value.field == field and field in str(e.value)


def test_from_hf_config_json_unreadable(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        from_hf_config_json(bad)


# ------------------------------------------------------------ rope / hadamard / norms


def _complex_rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, pairs: str):
    """Direct formula: view pairs as complex numbers, multiply by e^(i pos freq)."""
    d = x.shape[-1]
    x64 = x.double()
    if pairs == "interleaved":
        z = torch.complex(x64[..., 0::2], x64[..., 1::2])
    else:
        z = torch.complex(x64[..., : d // 2], x64[..., d // 2 :])
    rot = torch.polar(
        torch.ones_like(pos.double()[:, None] * inv.double()), pos.double()[:, None] * inv.double()
    )
    z = z * rot.view(rot.shape[0], *([1] * (x.dim() - 2)), -1)
    out = torch.empty_like(x64)
    if pairs == "interleaved":
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2 :] = z.real, z.imag
    return out


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_rope_matches_complex_formula(pairs: str) -> None:
    cfg = DSV32Config.full()
    inv = yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    pos = torch.tensor([0, 1, 7, 4095, 4096, 100_000], dtype=torch.int32)
    x = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(pos, inv)
    fn = apply_rope_interleaved if pairs == "interleaved" else apply_rope_half
    got = fn(x, cos, sin)
    ref = _complex_rope(x, pos, inv, pairs)
    # fp32 angles (as the reference model computes them) err by ~pos * 6e-8 rad
    torch.testing.assert_close(got[:3].double(), ref[:3], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[3:5].double(), ref[3:5], atol=2e-3, rtol=0)
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4)  # rotation
    other = apply_rope_half if pairs == "interleaved" else apply_rope_interleaved
    assert not torch.allclose(other(x, cos, sin)[1:], got[1:])  # the layouts really differ


def test_yarn_frequencies() -> None:
    theta, rs = 10000.0, YarnScaling()
    plain = 1.0 / theta ** (torch.arange(0, 64, 2).double() / 64)
    assert torch.allclose(yarn_inv_freq(64, theta, rs, 4096).double(), plain)  # not extended
    assert torch.allclose(yarn_inv_freq(64, theta, None, 163840).double(), plain)
    ext = yarn_inv_freq(64, theta, rs, 163840).double()
    assert torch.allclose(ext[:8], plain[:8])  # fast (high-frequency) pairs kept
    assert torch.allclose(ext[-4:], plain[-4:] / 40)  # slow pairs interpolated by factor
    assert ((ext <= plain * (1 + 1e-6)) & (ext >= plain / 40 * (1 - 1e-6))).all()


def test_hadamard_orthogonal_and_sylvester() -> None:
    h2 = hadamard_matrix(2)
    assert h2.tolist() == [[1, 1], [1, -1]]
    h4 = hadamard_matrix(4)
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    h = hadamard_matrix(128)
    assert torch.equal(h @ h.t(), 128 * torch.eye(128))
    x = torch.randn(5, 128)
    y = hadamard_rotate(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
    assert torch.allclose(hadamard_rotate(y), x, atol=1e-5)  # H symmetric: its own inverse
    assert torch.allclose(y, (x.double() @ h.double().t() / math.sqrt(128)).float(), atol=1e-6)
    with pytest.raises(ValueError, match="power of 2"):
        hadamard_matrix(96)


def test_rmsnorm_computes_in_fp32() -> None:
    norm = RMSNorm(256, eps=1e-6)
    norm.weight.data = torch.rand(256) + 0.5
    assert norm.weight.dtype == torch.float32
    x = (torch.randn(4, 256) * 30).to(torch.bfloat16)
    xf = x.float()
    ref = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.bfloat16()
    assert not torch.equal(out, naive)  # a bf16 computation would differ


def test_layernorm_weight_and_bias() -> None:
    ln = LayerNorm(128)
    ln.weight.data, ln.bias.data = torch.rand(128) + 0.5, torch.randn(128)
    x = torch.randn(3, 128) * 4 + 2
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(ln(x), (x - mu) / torch.sqrt(var + 1e-6) * ln.weight + ln.bias)


# --------------------------------------------------------------------------- MoE


def _gate_with_logits(cfg: DSV32Config, logits: list[float], bias: list[float] | None = None):
    """A gate whose router logits for input e_0..e_7 (one-hot rows) are ``logits``."""
    gate = Gate(cfg, torch.float32)
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, 0] = torch.tensor(logits)
        gate.bias.copy_(torch.tensor(bias or [0.0] * len(logits)))
    x = torch.zeros(1, cfg.hidden_size)
    x[0, 0] = 1.0
    return gate, x


def test_moe_group_limited_routing() -> None:
    logits = [3.0, -3.0, 2.0, 1.9, 1.5, 1.5, 0.0, 0.0]  # groups {0,1} {2,3} {4,5} {6,7}
    sig = torch.sigmoid(torch.tensor(logits))
    # Group scores (sum of top-2): g0 = 1.0, g1 = 1.75, g2 = 1.64, g3 = 1.0: keep g1, g2.
    # Expert 0 is the best single expert but its group is dropped.
    gate, x = _gate_with_logits(DSV32Config.tiny(), logits)
    w, idx = gate(x)
    assert idx[0].tolist() == [2, 3]
    expected = sig[[2, 3]] / sig[[2, 3]].sum() * 2.5
    torch.testing.assert_close(w[0], expected)
    assert math.isclose(float(w.detach().sum()), 2.5, rel_tol=1e-6)

    ungrouped, x = _gate_with_logits(tiny(n_group=1, topk_group=1), logits)
    assert ungrouped(x)[1][0].tolist() == [0, 2]


def test_moe_bias_changes_choice_not_weight() -> None:
    logits = [3.0, -3.0, 2.0, 1.9, 1.5, 1.5, 0.0, 0.0]
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # lifts expert 5 (and its group)
    gate, x = _gate_with_logits(DSV32Config.tiny(), logits, bias)
    w, idx = gate(x)
    assert idx[0].tolist() == [5, 2]
    sig = torch.sigmoid(torch.tensor(logits))
    torch.testing.assert_close(w[0], sig[[5, 2]] / sig[[5, 2]].sum() * 2.5)  # unbiased


def test_moe_forward_matches_per_token_loop() -> None:
    cfg = DSV32Config.tiny()
    torch.manual_seed(0)
    moe = MoE(cfg, torch.float32)
    with torch.no_grad():
        for p in (moe.gate.weight, moe.w1, moe.w2, moe.w3):
            p.normal_(0, 0.2)
        moe.gate.bias.normal_(0, 0.1)
    x = torch.randn(5, cfg.hidden_size)
    weights, indices = moe.gate(x)
    ref = moe.shared(x)
    for r in range(5):
        for w, e in zip(weights[r], indices[r], strict=True):
            expert = MLP(cfg.hidden_size, cfg.moe_intermediate_size, torch.float32)
            expert.w1.weight.data, expert.w2.weight.data = moe.w1[e], moe.w2[e]
            expert.w3.weight.data = moe.w3[e]
            ref[r] += w * expert(x[r])
    torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- MLA


def _expanded_attention(mla: MLA, xs: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor):
    """Non-absorbed reference: expand K/V per head with wkv_b, ordinary attention.

    The last row of ``xs`` is the query token; all rows are its context.
    """
    cos, sin = rope_cos_sin(pos, inv)
    _, q_nope, q_rope = mla.project_q(xs[-1:], cos[-1:], sin[-1:])
    latent, k_rope = mla.project_kv(xs, cos, sin)
    n, h = xs.shape[0], mla.n_heads
    kv = mla.wkv_b(latent).view(n, h, mla.nope + mla.v_dim)
    k_nope, v = kv.split([mla.nope, mla.v_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None, :].expand(n, h, mla.rope)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)[0]  # [H, nope + rope]
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * mla.softmax_scale, dim=-1)
    return mla.wo(torch.einsum("hn,nhd->hd", p, v).flatten())


def _requests_on_pages(cfg: DSV32Config, *requests: tuple[int, list[int]]):
    """Rope frequencies, a 6-page cache, and a request pool holding each (length, pages)."""
    inv = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, 163840)
    cache = PagedKVCache(cfg, 6, dtype=torch.float32)
    pool = RequestPool(4, 256, page_size=PAGE)
    lengths = {pool.alloc(): n for n, _ in requests}
    for r, (n, pages) in zip(lengths, requests, strict=True):
        pool.assign(r, pages, n)
    return inv, cache, pool, lengths


def _token_steps(pool: RequestPool, lengths: dict[int, int], cfg, inv, *inputs):
    """Feed every request one token a step: per step, the live requests, their plan, rope and
    their rows of each of ``inputs`` (per-request ``[tokens, ...]`` tensors)."""
    for step in range(max(lengths.values())):
        live = [r for r, n in lengths.items() if step < n]
        plan = make_plan(pool, live, [step + 1] * len(live), cfg.index_topk)
        cos, sin = rope_cos_sin(plan.positions, inv)
        yield step, live, plan, cos, sin, [torch.stack([x[r][step] for r in live]) for x in inputs]


def test_mla_absorbed_decode_equals_expanded_attention() -> None:
    cfg = tiny(index_topk=128)  # top-k covers every length: sparse == dense
    torch.manual_seed(0)
    mla = MLA(cfg, torch.float32)
    with torch.no_grad():
        mla.q_norm.weight.uniform_(0.5, 1.5)
        mla.kv_norm.weight.uniform_(0.5, 1.5)
    # 70 tokens cross a page boundary; pages out of order on purpose
    inv, cache, pool, lengths = _requests_on_pages(cfg, (70, [4, 2]), (5, [5]))
    xs = {r: torch.randn(n, cfg.hidden_size) for r, n in lengths.items()}
    for step, live, plan, cos, sin, (x,) in _token_steps(pool, lengths, cfg, inv, xs):
        out = mla(x, cos, sin, plan, cache.mla[0], cache.index[0])
        for row, r in enumerate(live):
            pos = torch.arange(step + 1, dtype=torch.int32)
            ref = _expanded_attention(mla, xs[r][: step + 1], pos, inv)
            torch.testing.assert_close(out[row], ref, atol=2e-5, rtol=1e-4)
    assert not cache.mla[0][:PAGE].any()  # nothing wrote the null page


# ----------------------------------------------------------------------- indexer


def test_indexer_fp8_path_matches_float_reference() -> None:
    from backends.deepgemm import fp8

    cfg = DSV32Config.tiny()  # index_topk 16
    torch.manual_seed(0)
    idx = Indexer(cfg, torch.float32).requires_grad_(False)
    with torch.no_grad():
        idx.k_norm.weight.uniform_(0.5, 1.5)
        idx.k_norm.bias.normal_(0, 0.1)
    inv, cache, pool, lengths = _requests_on_pages(cfg, (100, [3, 1]), (9, [2]))
    xs = {r: torch.randn(n, cfg.hidden_size) for r, n in lengths.items()}
    qrs = {r: torch.randn(n, cfg.q_lora_rank) for r, n in lengths.items()}
    for _, _, plan, cos, sin, (x, qr) in _token_steps(pool, lengths, cfg, inv, xs, qrs):
        topk = idx(x, qr, cos, sin, plan, cache.index[0])
    keys, scales = fp8.unpack_index_kv_cache(cache.index[0])
    for r, n in lengths.items():
        pos = torch.arange(n, dtype=torch.int32)
        cos, sin = rope_cos_sin(pos, inv)
        q, k, w = idx.project(xs[r], qrs[r], cos, sin)
        ref = (torch.relu(torch.einsum("hd,td->ht", q[-1], k)) * w[-1][:, None]).sum(0)
        # fp8 path: what the layer cached, against its quantised query
        slots = pool.req_to_token[r, :n].long()
        k8 = keys[slots].float() * scales[slots][:, None]
        q8, qs = fp8.quantize_fp8_e4m3_per_vector(q[-1], block=cfg.index_head_dim)
        q8 = q8.float() * qs
        got = (torch.relu(q8 @ k8.t()) * w[-1][:, None]).sum(0)
        # worst case: e4m3 rounds each factor by <= 2^-4 relative (3 mantissa bits)
        bound = (w[-1].abs()[:, None] * (q[-1].abs() @ k.abs().t())).sum(0) * 0.13
        assert ((got - ref).abs() <= bound).all()
        assert (got - ref).abs().mean() <= 0.02 * ref.abs().max()  # typical error is small
        if n == 100:  # only this request is live at the last step: row 0
            chosen = set(topk[0].tolist())
            best = set(slots[ref.topk(cfg.index_topk).indices].tolist())
            assert len(chosen) == cfg.index_topk and chosen <= set(slots.tolist())
            assert len(chosen & best) >= cfg.index_topk - 3  # only near-ties may swap


def test_indexer_short_request_selects_everything(model: DSV32Model) -> None:
    s = Session(model)
    r = s.add()
    for i in range(5):
        _, plan = s.step([r], [i + 1], [7 + i])
    block = model.layers[0].attn
    # Recompute the last step's top-k through the layer on fresh input: the cache holds
    # 5 tokens, top-k 16: all 5 real slots, then -1.
    x = torch.randn(1, model.config.hidden_size)
    cos, sin = rope_cos_sin(plan.positions, model.inv_freq)
    qr, _, _ = block.project_q(x, cos, sin)
    out = block.indexer(x, qr, cos, sin, plan, s.cache.index[0])[0].tolist()
    assert sorted(out[:5]) == s.pool.req_to_token[r, :5].tolist() and out[5:] == [-1] * 11


# ------------------------------------------------------------------ whole model


def test_init_is_deterministic_per_seed() -> None:
    cfg = DSV32Config.tiny()
    a = DSV32Model(cfg, seed=3, dtype=torch.float32).state_dict()
    b = DSV32Model(cfg, seed=3, dtype=torch.float32).state_dict()
    c = DSV32Model(cfg, seed=4, dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.1.attn.wq_b.weight"], c["layers.1.attn.wq_b.weight"])


def test_save_load_bit_identical(tmp_path: Path, model: DSV32Model) -> None:
    path = tmp_path / "tiny.safetensors"
    model.save(path)
    loaded = DSV32Model.from_file(path)
    assert loaded.dtype == torch.float32
    into = DSV32Model(model.config, seed=99, dtype=torch.float32).load(path)
    prompts = [[1, 2, 3, 4, 5] * 4, [9, 8, 7]]
    out = [greedy(m, prompts, 1) for m in (model, loaded, into)]
    assert out[0] == out[1] == out[2]
    s = [Session(m) for m in (model, loaded, into)]
    logits = []
    for sess in s:
        r = sess.add()
        logits.append(sess.step([r], [1], [42])[0])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_load_refuses_other_config(tmp_path: Path, model: DSV32Model) -> None:
    path = tmp_path / "tiny.safetensors"
    model.save(path)
    other = DSV32Model(tiny(index_topk=8), seed=0, dtype=torch.float32)
    with pytest.raises(ConfigError) as e:
        other.load(path)
    assert e.value.field == "index_topk"
    with pytest.raises(ConfigError, match="dtype|differs"):
        DSV32Model(model.config, seed=0, dtype=torch.bfloat16).load(path)


def test_greedy_decode_is_deterministic_and_batch_invariant(model: DSV32Model) -> None:
    prompts = [list(range(3, 23)), [5, 6, 7], list(range(100, 130))]  # 20, 3 and 30 > topk
    first = greedy(model, prompts, 6)
    assert greedy(model, prompts, 6) == first
    assert greedy(model, prompts[:1], 6) == first[:1]  # alone == in a batch
    assert len({tuple(t) for t in first}) == 3


def test_padding_request_does_not_disturb_real_rows(model: DSV32Model) -> None:
    def run(pad: bool) -> torch.Tensor:
        s = Session(model)
        r = s.add()
        for i in range(20):
            reqs, lens, ids = [r], [i + 1], [i + 3]
            if pad:  # the null request: length 1, writes and reads slot 0
                reqs, lens, ids = [r, 0], [i + 1, 1], [i + 3, 0]
            logits, plan = s.step(reqs, lens, ids)
        if pad:
            assert plan.out_cache_loc[1] == 0
        return logits[0]

    torch.testing.assert_close(run(True), run(False), atol=1e-5, rtol=1e-5)


def test_mtp_step_equals_two_single_steps(model: DSV32Model) -> None:
    """next_n = 2 (speculative verify): row 0 must not see row 1's token."""
    prompt = list(range(10, 31))

    def run(next_n: int) -> torch.Tensor:
        s = Session(model)
        r = s.add()
        for i, t in enumerate(prompt[:-2]):
            s.step([r], [i + 1], [t])
        n = len(prompt)
        if next_n == 2:
            return s.step([r], [n], prompt[-2:], next_n=2)[0]
        a = s.step([r], [n - 1], [prompt[-2]])[0]
        return torch.cat([a, s.step([r], [n], [prompt[-1]])[0]])

    torch.testing.assert_close(run(2), run(1), atol=1e-4, rtol=1e-4)


def test_plan_errors_name_the_field(model: DSV32Model) -> None:
    s = Session(model)
    r = s.add()
    s.pool.assign(r, s.cache.alloc(1), 1)
    plan = make_plan(s.pool, [r], [1], model.config.index_topk)
    ids = torch.tensor([1])
    for name in ("out_cache_loc", "positions"):
        short = types.SimpleNamespace(**{**vars(plan), name: getattr(plan, name)[:0]})
        with pytest.raises(PlanError) as e:
            model(ids, {"nsa": short}, s.cache)
        assert e.value.field == name
    with pytest.raises(PlanError) as e:
        model(ids, {"nsa": types.SimpleNamespace(**{**vars(plan), "topk": 8})}, s.cache)
    assert e.value.field == "topk"
    with pytest.raises(PlanError) as e:
        model(torch.tensor([1, 2]), {"nsa": plan}, s.cache)
    assert e.value.field == "input_ids"


def test_the_engine_refuses_a_planner_that_does_not_make_the_models_plans() -> None:
    """Layers read typed NSA plans with no per-step guard: the planner is checked once."""
    limits = Limits(max_batch=2, max_context=128)
    with pytest.raises(SchemaError) as e:
        Planner(["paged"], limits).check_serves(DSV32Model.PLANS)
    assert e.value.field == "nsa"
    Planner(["nsa"], limits).check_serves(DSV32Model.PLANS)  # the NSA plan itself

    class OtherPlan(PagedPlan, backend="other_nsa_like"):
        pass

    planner = Planner([OtherPlan], limits)
    with pytest.raises(SchemaError, match="reads NSAPlan"):
        planner.check_serves({"other_nsa_like": DSV32Model.PLANS["nsa"]})


def test_deep_model_activations_stay_sane() -> None:
    cfg = tiny(num_hidden_layers=61, first_k_dense_replace=3)
    m = DSV32Model(cfg, seed=0, dtype=torch.float32)
    s = Session(m)
    reqs = [s.add(), s.add()]
    for i in range(3):
        logits, _ = s.step(reqs, [i + 1, i + 1], [1 + i, 200 + i])
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0


class _SyncDetector(TorchDispatchMode):
    """Records ops that sync the host or have data-dependent shapes, and who called them."""

    BAD = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(b in name for b in self.BAD):
            ours = [f.filename for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
            owner = next((f for f in reversed(ours) if "/tests/" not in f), "?")
            self.hits.append((name, owner))
        return func(*args, **(kwargs or {}))


def test_model_code_has_no_host_syncs(model: DSV32Model) -> None:
    """Graph capture forbids syncs; the CPU backends may validate values, the model may not."""
    s = Session(model)
    reqs = [s.add(), s.add()]
    for i in range(2):
        s.step(reqs, [i + 1, i + 2], [1, 2])
    for r, n in zip(reqs, (3, 4), strict=True):
        s.pool.assign(r, s.pages[r], n)
    plan = make_plan(s.pool, reqs, [3, 4], model.config.index_topk)
    detector = _SyncDetector()
    with detector:
        model(torch.tensor([3, 4]), {"nsa": plan}, s.cache)
    assert [h for h in detector.hits if "/models/" in h[1]] == []


def test_plans_from_the_real_planner(model: DSV32Model) -> None:
    """Eager plans give the helper's logits bit for bit; replays give padded eager's.

    Padded and unpadded batches are not compared: CPU matmuls differ in the last
    bit with the row count, and fp8 rounding in the indexer can turn that into a
    different top-k (a discrete change), which is model behaviour, not a plan bug.
    """
    from planner import ForwardBatch, Limits, Planner

    limits = Limits(max_batch=4, max_context=256, page_size=PAGE, num_sms=8)
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": model.config.index_topk}})
    s = Session(model, max_context=256)
    planner.capture(4, req_to_token=s.pool.req_to_token)
    reqs = [s.add() for _ in range(3)]
    start = {reqs[0]: 0, reqs[1]: 4, reqs[2]: 9}  # different lengths, past top-k
    for step in range(26):
        live = [r for r in reqs if step >= start[r]]
        lens = [step - start[r] + 1 for r in live]
        ids = [(7 * r + n) % model.config.vocab_size for r, n in zip(live, lens, strict=True)]
        for r, n in zip(live, lens, strict=True):
            while len(s.pages[r]) * PAGE < n:
                s.pages[r] += s.cache.alloc(1)
            s.pool.assign(r, s.pages[r], n)
        idx = torch.tensor(live, dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        loc = s.pool.req_to_token[idx.long(), (seq - 1).long()]
        batch = ForwardBatch(seq, idx, s.pool.req_to_token, loc)
        ref = model(torch.tensor(ids), {"nsa": make_plan(s.pool, live, lens, 16)}, s.cache)
        assert torch.equal(model(torch.tensor(ids), planner.plan(batch), s.cache), ref)
        padded = torch.tensor(ids + [0] * (4 - len(ids)))
        eager = model(padded, planner.plan(batch, pad_to=4), s.cache)
        plans = planner.replay(batch, 4)
        planner.record(4)  # what replaying the captured graph would run
        assert torch.equal(model(padded, plans, s.cache), eager)


def test_plan_topk_other_than_the_models_is_refused_before_the_first_layer(
    model: DSV32Model, monkeypatch
) -> None:
    """A plan built for another model: the model refuses it before any layer runs."""
    cache = model.new_cache(4 * 256 // PAGE + 1)
    setup = PlannerSetup(("nsa",), max_batch=4, max_context=256, page_size=PAGE, pool=5)
    planner = setup.planner(kv_slots=cache.num_slots, options={"nsa": {"topk": 2048}})
    batch = setup.batch(random.Random(0), bs=2)
    layers: list[int] = []
    original = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a: layers.append(1) or original(self, *a))
    with pytest.raises(PlanError) as info:
        model(torch.zeros(2, dtype=torch.int64), planner.plan(batch), cache)
    assert info.value.field == "topk" and "expected 16, got 2048" in str(info.value)
    assert layers == []


def test_a_warm_up_runs_the_first_layer_of_each_kind(model: DSV32Model) -> None:
    """``first_of_each_kind``: the dense layers and the MoE (or stand-in) layers are two
    kinds; ``forward(layers=...)`` runs those alone, and every layer by default."""
    assert model.first_of_each_kind() == [0, 1]  # tiny: one dense layer, three MoE
    shapes = DSV32Model(DSV32Config.shapes(), device="meta")
    assert shapes.first_of_each_kind() == [0, shapes.config.first_k_dense_replace]
    ran: list[int] = []
    hooks = [
        block.register_forward_hook(lambda _m, _a, _o, i=i: ran.append(i))
        for i, block in enumerate(model.layers)
    ]
    try:
        s = Session(model)
        r = s.add()
        s.pool.assign(r, s.cache.alloc(1), 3)
        plan = make_plan(s.pool, [r], [3], model.config.index_topk)
        ids = torch.tensor([5])
        whole = model(ids, {"nsa": plan}, s.cache)
        assert ran == [0, 1, 2, 3]
        every = model(ids, {"nsa": plan}, s.cache, layers=[0, 1, 2, 3])
        ran.clear()
        part = model(ids, {"nsa": plan}, s.cache, layers=model.first_of_each_kind())
        assert ran == [0, 1]
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(every, whole) and part.shape == whole.shape
