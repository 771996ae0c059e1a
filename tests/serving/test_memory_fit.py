"""The memory a run needs, worked out before it allocates, against what it really allocates.

The estimate is held to reality term by term: the weights' bytes equal the real model's
parameters and buffers, the KV cache's and the request map's bytes equal the engine's own,
and the CPU forward's term is within 15% of the peak the real sparse attention reaches
(a subprocess's peak RSS). The refusal is tested with the device's figure injected, and the
figure itself with a real ``RLIMIT_AS`` in a subprocess; the command line's cases are in
``tests/serving/test_cli_catalogue.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import PagedKVCache, cache_bytes
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import MTPDraft, mtp_config
from dsv32_engine.serving import memory_fit
from dsv32_engine.serving.memory_fit import (
    GIB,
    Available,
    MemoryFitError,
    allocation_errors,
    check_memory,
    cpu_forward_row_bytes,
    estimate,
    size,
    weight_bytes,
)
from dsv32_engine.serving.run_config import load_run_config
from tests.support import REPO
from tests.support.engines import SMALL_LOOP, tiny_engine

CPU = torch.device("cpu")


def _real_bytes(*modules: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers())
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_equal_the_built_models(dtype):
    """Exact: the estimate builds the same modules on ``meta`` (norms stay float32)."""
    cfg = DSV32Config.tiny()
    model = DSV32Model(cfg, device="cpu", dtype=dtype)
    assert weight_bytes(cfg, dtype) == _real_bytes(model)
    draft = MTPDraft(model)
    assert weight_bytes(cfg, dtype, mtp=True) == _real_bytes(model, draft)
    assert weight_bytes(cfg, dtype) >= cfg.param_count() * dtype.itemsize // 2  # sane scale


def test_cache_bytes_equal_the_caches_own():
    cfg = DSV32Config.tiny()
    for c in (cfg, mtp_config(cfg)):
        for dtype in (torch.float32, torch.bfloat16):
            cache = PagedKVCache(c, 7, dtype=dtype)
            assert cache_bytes(c, 7, dtype) == cache.nbytes()


@pytest.mark.parametrize("draft", ["none", "mtp"])
def test_the_estimate_of_the_caches_equals_what_the_engine_allocates(draft):
    overrides = {**SMALL_LOOP, "speculative.draft": draft}
    engine = tiny_engine(overrides)
    need = estimate(engine.config, CPU)
    allocated = engine.cache.nbytes()
    if engine.speculation is not None and engine.speculation.mtp is not None:
        allocated += engine.speculation.cache.nbytes()
    assert need.term("KV cache").nbytes == allocated
    pool = engine.pool.req_to_token
    assert need.term("request map").nbytes == pool.numel() * pool.element_size()
    weights = [engine.model] + ([engine.speculation.mtp] if draft == "mtp" else [])
    assert need.term("weights").nbytes == _real_bytes(*weights)


MLA_PEAK = """
import sys, torch
from backends.nsa.attention import sparse_mla_decode
def peak():  # this process image's high-water RSS: ru_maxrss would keep the forking parent's
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))
rows, topk, heads, latent, rope, dtype = (*map(int, sys.argv[1:6]), getattr(torch, sys.argv[6]))
torch.set_num_threads(1)
kv = torch.randn(4096, latent + rope).to(dtype)
q, q_rope = torch.randn(rows, heads, latent).to(dtype), torch.randn(rows, heads, rope).to(dtype)
slots = torch.randint(0, 4096, (rows, topk), dtype=torch.int32)
sparse_mla_decode(q[:1], q_rope[:1], kv, slots[:1], 0.1)
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the high-water mark starts again from the RSS now
base = peak()
sparse_mla_decode(q, q_rope, kv, slots, 0.1)
print(peak() - base)
"""


@pytest.mark.parametrize(
    "rows, topk, heads, dtype",
    [(256, 512, 16, "bfloat16"), (256, 512, 16, "float32"), (64, 2048, 128, "bfloat16")],
)
def test_the_cpu_forward_term_is_the_sparse_attentions_real_peak(rows, topk, heads, dtype):
    """The term per row times the rows, against the peak RSS the real op adds (Linux's
    ``VmHWM``, reset before the op, in a fresh process), within 15%: the slots widened to float64 dominate at
    few heads, the float64 logits at many."""
    latent, rope = 512, 64
    cfg = DSV32Config.tiny().model_copy(
        update={
            "index_topk": topk,
            "num_attention_heads": heads,
            "kv_lora_rank": latent,
            "qk_rope_head_dim": rope,
        }
    )
    want = rows * cpu_forward_row_bytes(cfg, getattr(torch, dtype))
    args = [str(v) for v in (rows, topk, heads, latent, rope, dtype)]
    proc = subprocess.run(
        [sys.executable, "-c", MLA_PEAK, *args], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.strip())
    assert 0.85 * want <= peak <= 1.15 * want, (peak / GIB, want / GIB)


def _small_on_cpu(**overrides):
    return load_run_config("dsv32-small", {"device": "cpu", **overrides})


def test_a_config_that_cannot_fit_is_refused_naming_the_largest_term():
    small = _small_on_cpu()
    with pytest.raises(MemoryFitError) as info:
        check_memory(small, available=Available(8 * GIB, "a test's figure"))
    err = info.value
    assert err.field == "loop.chunk_tokens" and "forward activations" in str(err)
    assert "8.0 GiB available (a test's figure)" in str(err)
    assert "\n" not in str(err)
    # the value it proposes does fit, and one more row does not
    fits = int(str(err.expected).removeprefix("<= "))
    assert check_memory(
        _small_on_cpu(**{"loop.chunk_tokens": fits}), available=Available(8 * GIB, "")
    )
    with pytest.raises(MemoryFitError):
        check_memory(
            _small_on_cpu(**{"loop.chunk_tokens": fits + 1}), available=Available(8 * GIB, "")
        )


def test_weights_too_large_are_named_on_the_model():
    config = load_run_config(None, {"model.preset": "full"})
    with pytest.raises(MemoryFitError) as info:
        check_memory(config, available=Available(64 * GIB, "a test's figure"))
    weights = weight_bytes(DSV32Config.full(), torch.float32)  # the tiny YAML's dtype
    assert abs(weights - 4 * DSV32Config.full().param_count()) < 0.001 * weights
    assert info.value.field == "model.preset" and f"weights {size(weights)}" in str(info.value)


def test_the_kv_cache_term_proposes_the_pages_that_fit():
    config = load_run_config(None, {"loop.kv_pages": 200_000})
    need = estimate(config, CPU)
    room = 200 << 20
    with pytest.raises(MemoryFitError) as info:
        check_memory(config, available=Available(room, "a test's figure"))
    assert info.value.field == "loop.kv_pages"
    pages = int(str(info.value.expected).removeprefix("<= "))
    others = need.total - need.term("KV cache").nbytes
    per_page = need.term("KV cache").nbytes // 200_000
    assert others + pages * per_page <= room < others + (pages + 1) * per_page


def test_cpu_ranks_share_the_host():
    config = load_run_config(None, {"distributed.dp_attention": 2})
    one = check_memory(load_run_config(None), available=Available(GIB, ""))
    two = check_memory(config, available=Available(GIB, ""))
    assert two.ranks == 2 and two.total == 2 * one.total


def test_the_default_config_fits_and_unknown_memory_refuses_nothing(monkeypatch):
    assert check_memory(load_run_config(None)).total < 64 << 20
    monkeypatch.setattr(memory_fit, "cpu_available", lambda: None)  # off Linux, no limit
    assert check_memory(_small_on_cpu()) is not None  # estimated, not refused


AS_PROBE = """
import json, resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from dsv32_engine.serving.memory_fit import _address_space_available, cpu_available
limit, mapped = _address_space_available()
got = cpu_available()
print(json.dumps({"limit": limit, "mapped": mapped, "nbytes": got.nbytes, "source": got.source}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
def test_an_address_space_limit_is_what_the_cpu_has():
    proc = subprocess.run(
        [sys.executable, "-c", AS_PROBE], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["limit"] == 4 << 30 and 0 < got["mapped"] < got["limit"]
    assert got["nbytes"] <= got["limit"] - got["mapped"]
    assert got["source"].startswith("RLIMIT_AS 4.0 GiB less") or got["nbytes"] < (4 << 30) // 2


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 19327352832 bytes. Error code 12\nmore"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
    ],
)
def test_an_allocation_that_fails_anyway_is_one_line(failure):
    @allocation_errors
    def run() -> None:
        raise failure

    with pytest.raises(MemoryFitError) as info:
        run()
    assert "\n" not in str(info.value) and "allocation failed" in str(info.value)


def test_other_errors_pass_through():
    @allocation_errors
    def run() -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run()


def test_on_a_gpu_the_check_is_the_kv_sizing_rule_plus_what_it_leaves_out():
    """On CUDA the KV cache is sized from the memory the weights leave (``kv_pages``): the
    estimate's weights, least KV cache, graph reserve and the share ``kv_memory_fraction``
    keeps back fit ``free`` exactly when ``kv_pages`` would find one request's pages (the
    fused projections' copy and the request map come on top). No GPU is touched."""
    config = load_run_config("dsv32-small")
    gpu = torch.device("cuda", 0)
    loop = config.loop
    for free in [g * GIB // 4 for g in range(16, 40)]:
        need = estimate(config, gpu, free=free)
        extra = need.term("fusing projections").nbytes + need.term("request map").nbytes
        weights, kv = need.term("weights").nbytes, need.term("KV cache").nbytes
        budget = int((free - weights) * loop.kv_memory_fraction) - (loop.graph_reserve_mb << 20)
        sizing_fits = budget >= kv  # kv_pages: fits - 1 >= pages of one request
        assert (need.total - extra <= free + 1) == sizing_fits, free / GIB
