"""The checks of benchmarks/verify_deepgemm.py: one case against the references.

Each check takes the native kernel or ``None`` (the reference stands in, for a smoke
run on the CPU) and returns the case with its results, so the script's JSON and the
GPU tests read the same dictionaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.deepgemm import reference_fp8_paged_mqa_logits, reference_paged_mqa_schedule
from benchmarks.common import num_sms_of
from benchmarks.deepgemm_cases import abs_inputs, make_lens, make_logits_inputs

LOGITS_TOL = 2.0**-9  # |kernel - reference| <= LOGITS_TOL * magnitude bound


def first_diff(a: torch.Tensor, b: torch.Tensor) -> Any:
    rows = (a != b).any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return None
    r = rows[0]
    return {"row": r, "got": a[r].tolist(), "want": b[r].tolist(), "rows_differing": len(rows)}


def check_schedule(case: dict[str, Any], native: Callable | None, device: torch.device) -> dict:
    """One schedule case: kernel (or stand-in) vs the CPU and on-device references."""
    lens = make_lens(case["batch"], case["next_n"], case["max_len"], case["kind"], case["seed"])
    n = case["num_sms"]
    ref_old = reference_paged_mqa_schedule(lens, 64, n, "0.1.0")
    ref_new = reference_paged_mqa_schedule(lens, 64, n, "new")
    ref_dev = reference_paged_mqa_schedule(lens.to(device), 64, n, "0.1.0").cpu()
    got = (native or reference_paged_mqa_schedule)(lens.to(device), 64, n).cpu()
    res = dict(case)
    res.update(
        ok=bool(torch.equal(got, ref_old) and torch.equal(ref_dev, ref_old)),
        matches_010=bool(torch.equal(got, ref_old)),
        matches_new=bool(torch.equal(got, ref_new)),
        layouts_differ=not torch.equal(ref_old, ref_new),
        device_ref_ok=bool(torch.equal(ref_dev, ref_old)),
    )
    if not res["matches_010"]:
        res["diff"] = first_diff(got, ref_old)
    return res


def check_logits(case: dict[str, Any], native: Callable | None, device: torch.device) -> dict:
    """One logits case: kernel (or stand-in) vs the reference below each row's length."""
    b, nn, h = case["batch"], case["next_n"], case["heads"]
    lens = make_lens(b, nn, case["max_len"], case["kind"], case["seed"])
    width = int(lens.max()) + case["extra_width"]
    q, cache, w, lens_d, table = make_logits_inputs(b, nn, h, lens, case["seed"], device)
    sched = reference_paged_mqa_schedule(lens, 64, num_sms_of(device)).to(device)
    args = (q, cache, w, lens_d, table, sched, width)
    got = (native or reference_fp8_paged_mqa_logits)(*args, False)
    ref = reference_fp8_paged_mqa_logits(*args)
    # Both MTP rows are computed over the last column's length (what "undefined" hides),
    # so the bound and the unmasked scores use that length for every row.
    last = lens_d[:, -1:].expand(-1, nn).contiguous()
    bound = reference_fp8_paged_mqa_logits(*abs_inputs(q, cache, w), last, table, sched, width)
    valid = torch.isfinite(ref)
    err = (got - ref).abs()
    ratio = torch.where(valid, err / bound.clamp(min=1e-30), torch.zeros_like(err))
    nan_valid = int((valid & ~torch.isfinite(got)).sum())
    x, y = got[valid].double(), ref[valid].double()
    denom = float((x * x + y * y).sum())
    cos_diff = 1.0 - 2.0 * float((x * y).sum()) / denom if denom > 0 else 0.0
    unmasked = reference_fp8_paged_mqa_logits(q, cache, w, last, table, sched, width)
    cover = torch.isfinite(unmasked)
    cover_err = ((got - unmasked).abs() / bound.clamp(min=1e-30))[cover & torch.isfinite(got)]
    covers_last = bool((torch.isfinite(got) | ~cover).all()) and (
        cover_err.numel() == 0 or float(cover_err.max()) <= LOGITS_TOL
    )
    res = dict(case)
    res.update(
        width=width,
        max_err_over_bound=float(ratio.max()) if ratio.numel() else 0.0,
        cos_diff=cos_diff,
        nonfinite_in_valid=nan_valid,
        rows_cover_last_len=covers_last,
        ok=bool(float(ratio.max() if ratio.numel() else 0.0) <= LOGITS_TOL and nan_valid == 0),
    )
    return res
