"""CUDA-graph checks of benchmarks/verify_deepgemm.py: capture once, replay, compare to eager.

The schedule (reference and deep_gemm's metadata kernel) and the indexer top-k + sparse
MLA path must give under replay what they give eagerly for new lengths and queries
copied into the captured buffers: that is what a serving step relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from backends.deepgemm import (
    PAGE,
    new_index_cache,
    paged_mqa_schedule_into,
    quantize_fp8_e4m3_per_vector,
    reference_paged_mqa_schedule,
    write_index_cache,
)
from backends.nsa import attention as nsa
from benchmarks.common import num_sms_of
from benchmarks.deepgemm_cases import KINDS, make_lens


def make_plan(seq_lens: list[int], next_n: int, topk: int, width: int, device, seed: int):
    """A plan object with the planner's attributes (pages scattered at random)."""
    g = torch.Generator().manual_seed(seed)
    reqs = len(seq_lens)
    cap = -(-width // PAGE)
    perm = torch.randperm(reqs * cap, generator=g) + 1  # page 0 is the null page
    slots = torch.zeros(reqs, cap * PAGE, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        t = torch.arange(n)
        slots[r, :n] = (perm[r * cap + t // PAGE] * PAGE + t % PAGE).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    kv = torch.stack([seq - (next_n - 1 - i) for i in range(next_n)], 1).reshape(-1)
    kv = kv.clamp(min=0).to(torch.int32)
    page_table = (slots[:, ::PAGE] // PAGE).contiguous().to(device)
    return SimpleNamespace(
        next_n=next_n,
        kernel_next_n=next_n,  # native rows: deep_gemm takes next_n 1 and 2 as they are
        topk=topk,
        max_seq_len=width,
        kv_lens=kv.to(device),
        token_slots=slots.to(device),
        page_table=page_table,
        kernel_page_table=page_table,
        schedule=reference_paged_mqa_schedule(
            kv.view(-1, next_n), 64, num_sms_of(torch.device(device))
        ).to(device),
        num_slots=(reqs * cap + 1) * PAGE,
    )


def _warm_on_side_stream(fn: Callable[[], Any], times: int = 2) -> None:
    """Warm-up the way torch.cuda.graphs recommends (JIT, cuBLAS workspaces) before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def graph_checks(device: torch.device, dg: Any) -> list[dict]:
    """Capture/replay equality for the schedule and the indexer + sparse MLA path."""
    out: list[dict] = []
    n_sms = num_sms_of(device)

    def record(name: str, fn: Callable[[], bool]) -> None:
        try:
            out.append({"name": name, "ok": bool(fn())})
        except Exception as exc:  # report, keep going
            out.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def ref_schedule_graph() -> bool:
        static = make_lens(200, 2, 5000, "uniform", 1).to(device)
        buf = torch.zeros(n_sms + 1, 2, dtype=torch.int32, device=device)
        _warm_on_side_stream(lambda: paged_mqa_schedule_into(buf, static, 64, n_sms))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            paged_mqa_schedule_into(buf, static, 64, n_sms)
        ok = True
        for s in range(5):
            lens = make_lens(200, 2, [300, 5000, 200_000][s % 3], KINDS[s % 4], 10 + s)
            static.copy_(lens)
            g.replay()
            ok &= torch.equal(buf.cpu(), reference_paged_mqa_schedule(lens, 64, n_sms))
        return ok

    def native_schedule_graph() -> bool:
        static = make_lens(64, 1, 5000, "uniform", 2).to(device)
        _warm_on_side_stream(lambda: dg.get_paged_mqa_logits_metadata(static, 64, n_sms))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = dg.get_paged_mqa_logits_metadata(static, 64, n_sms)
        ok = True
        for s in range(5):
            lens = make_lens(64, 1, [300, 5000, 200_000][s % 3], KINDS[s % 4], 20 + s)
            static.copy_(lens)
            g.replay()
            ok &= torch.equal(res.cpu(), reference_paged_mqa_schedule(lens, 64, n_sms))
        return ok

    def indexer_graph() -> bool:
        seq = [2, 77, 300, 4096, 2, 1000, 64, 65]
        plan = make_plan(seq, 2, 256, 4160, device, seed=3)
        heads = 64
        rows = len(seq) * 2
        g0 = torch.Generator().manual_seed(4)
        k_fp8, k_scale = quantize_fp8_e4m3_per_vector(
            torch.randn(plan.num_slots, 128, generator=g0).to(device)
        )
        cache = new_index_cache(plan.num_slots // PAGE, device=device)
        write_index_cache(cache, torch.arange(plan.num_slots, device=device), k_fp8, k_scale)
        kv = torch.randn(plan.num_slots, 576, generator=g0).to(device, torch.bfloat16)
        q = torch.zeros(rows, heads, 128, device=device, dtype=torch.float8_e4m3fn)
        w = torch.zeros(rows, heads, device=device)
        q_abs = torch.randn(rows, 16, 512, generator=g0).to(device, torch.bfloat16)
        q_rope = torch.randn(rows, 16, 64, generator=g0).to(device, torch.bfloat16)

        def step():
            slots = nsa.indexer_topk(plan, q, w, cache)
            return slots, nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, 192**-0.5)

        def fill(s: int) -> None:
            gg = torch.Generator().manual_seed(100 + s)
            qf, qs = quantize_fp8_e4m3_per_vector(torch.randn(rows, heads, 128, generator=gg))
            q.copy_(qf.to(device))
            w.copy_((torch.randn(rows, heads, generator=gg) * qs.squeeze(-1)).to(device))

        fill(0)
        _warm_on_side_stream(step)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            slots_s, out_s = step()
        ok = True
        for s in range(1, 4):
            fill(s)
            g.replay()
            slots_e, out_e = step()
            ok &= torch.equal(slots_s, slots_e) and torch.equal(out_s, out_e)
        return ok

    if device.type != "cuda":
        return [{"name": "graph", "ok": True, "skipped": "no CUDA"}]
    record("reference schedule_into capture/replay", ref_schedule_graph)
    if dg is not None:
        record("deep_gemm metadata capture/replay", native_schedule_graph)
    record("indexer_topk + sparse_mla_decode capture/replay", indexer_graph)
    return out
