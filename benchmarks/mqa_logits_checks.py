"""The checks of benchmarks/verify_mqa_logits.py: one case, the kernel called four ways.

``plain``, ``clean`` (``-inf`` outside the range), ``compressed`` (row ``r`` from
column 0) and, for a few cases, ``compressed_clean`` (which 0.1.0 rejects). Each is
gated on the relative error and on the error over the magnitude bound (the reference
over sign-cleared inputs), which bounds every rounding error where heads cancel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.deepgemm import mqa_logits_row_stride, reference_fp8_mqa_logits
from benchmarks.mqa_logits_cases import make_inputs

NEG_INF = float("-inf")


def sign_cleared(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` of an fp8 e4m3 tensor (the sign bit cleared): inputs of the magnitude bound."""
    return (x.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def compare(
    got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, inside: torch.Tensor, tol: float
) -> dict[str, Any]:
    """Errors of ``got`` against ``ref`` where ``inside``, and whether both gates pass."""
    res = dict(rel_err=0.0, err_over_bound=0.0, row_rel=0.0, elem_rel=0.0, nonfinite_inside=0)
    if not bool(inside.any()):
        return res | dict(ok=True)
    zero = torch.zeros((), device=got.device, dtype=torch.float64)
    err = torch.where(inside, (got.double() - ref.double()).abs(), zero)
    err = err.nan_to_num(nan=float("inf"))
    ref_abs = torch.where(inside, ref.double().abs(), zero)
    norm_ref = float(ref_abs.square().sum().sqrt())
    norm_err = float(err.square().sum().sqrt())
    res["rel_err"] = norm_err / norm_ref if norm_ref > 0 else (0.0 if norm_err == 0 else 1e30)
    ratio = torch.where(inside, err / bound.double().clamp(min=1e-30), zero)
    res["err_over_bound"] = float(ratio.max())
    row_max = ref_abs.amax(dim=1, keepdim=True)
    rows = row_max[:, 0] > 0
    if bool(rows.any()):
        res["row_rel"] = float((err.amax(dim=1, keepdim=True)[rows] / row_max[rows]).max())
    big = inside & (ref_abs >= 1e-3 * row_max) & (ref_abs > 0)
    if bool(big.any()):
        res["elem_rel"] = float((err[big] / ref_abs[big]).max())
    res["nonfinite_inside"] = int((inside & ~torch.isfinite(got)).sum())
    res["ok"] = (
        res["nonfinite_inside"] == 0 and res["rel_err"] <= tol and res["err_over_bound"] <= tol
    )
    return res


def shifted(full: torch.Tensor, ks: torch.Tensor, width: int) -> torch.Tensor:
    """The compressed layout of an uncompressed ``full``: column j of row r is ``ks[r] + j``."""
    idx = ks.long().unsqueeze(1) + torch.arange(width, device=full.device)
    return full.gather(1, idx.clamp(max=max(full.shape[1] - 1, 0)))


def run_case(
    case: dict[str, Any], kernel: Callable[..., torch.Tensor], device: torch.device, tol: float
) -> dict[str, Any]:
    inp = make_inputs(case, device)
    q, kv, w, ks, ke, n_kv = (inp[k] for k in ("q", "kv", "weights", "ks", "ke", "kv_tokens"))
    tokens = q.shape[0]
    args = (q, kv, w, ks, ke)
    ref = reference_fp8_mqa_logits(*args)
    bound = reference_fp8_mqa_logits(
        sign_cleared(q), (sign_cleared(kv[0]), kv[1].abs()), w.abs(), ks, ke
    )
    cols = torch.arange(n_kv, device=device)
    inside = (cols >= ks.long()[:, None]) & (cols < ke.long()[:, None])
    res: dict[str, Any] = dict(case, kv_tokens=n_kv, max_range=int((ke - ks).max()))

    got = kernel(*args, False, 0)
    plain = compare(got, ref, bound, inside, tol)
    plain["shape_ok"] = tuple(got.shape) == (tokens, n_kv)
    plain["stride_matches"] = got.stride(0) == mqa_logits_row_stride(n_kv)
    plain["ok"] = plain["ok"] and plain["shape_ok"]
    res["plain"] = plain

    got_c = kernel(*args, True, 0)
    clean = compare(got_c, ref, bound, inside, tol)
    clean["outside_all_neg_inf"] = bool((got_c[~inside] == NEG_INF).all())
    clean["inside_equals_plain"] = bool(torch.equal(got_c[inside], got[inside]))
    clean["ok"] = clean["ok"] and clean["outside_all_neg_inf"]
    res["clean"] = clean
    del got_c

    width = max(1, res["max_range"] + case["extra_width"])
    got_z = kernel(*args, False, width)
    ref_z = torch.where(
        torch.arange(width, device=device) < (ke - ks).long()[:, None],
        shifted(ref, ks, width),
        NEG_INF,
    )
    inside_z = torch.isfinite(ref_z)
    comp = compare(got_z, ref_z, shifted(bound, ks, width), inside_z, tol)
    comp["width"] = width
    comp["shape_ok"] = tuple(got_z.shape) == (tokens, width)
    comp["stride_matches"] = got_z.stride(0) == mqa_logits_row_stride(n_kv, width)
    comp["equals_plain_shifted"] = bool(
        torch.equal(got_z[inside_z], shifted(got, ks, width)[inside_z])
    )
    if case["seed"] % 8 == 0:  # the reference's own compressed path, on this device
        direct = reference_fp8_mqa_logits(*args, False, width)
        comp["reference_direct_equals_shifted"] = bool(torch.equal(direct, ref_z))
    comp["ok"] = comp["ok"] and comp["shape_ok"]
    comp["ok"] = comp["ok"] and comp.get("reference_direct_equals_shifted", True)
    res["compressed"] = comp
    return res


def compressed_clean(
    case: dict[str, Any], kernel: Callable[..., torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """0.1.0 asserts ``not clean_logits`` when compressed: a rejection is the expected result."""
    inp = make_inputs(case, device)
    ks, ke = inp["ks"], inp["ke"]
    width = max(1, int((ke - ks).max()))
    res: dict[str, Any] = dict(case, width=width)
    try:
        got = kernel(inp["q"], inp["kv"], inp["weights"], ks, ke, True, width)
    except Exception as exc:  # deep_gemm: RuntimeError from the host assert; ours: PlanError
        res.update(rejected=True, error=f"{type(exc).__name__}: {str(exc)[:200]}", ok=True)
        return res
    past = torch.arange(width, device=device) >= (ke - ks).long()[:, None]
    res.update(rejected=False, past_all_neg_inf=bool((got[past] == NEG_INF).all()))
    res["ok"] = res["past_all_neg_inf"]
    return res
