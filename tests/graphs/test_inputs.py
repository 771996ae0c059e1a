"""The runner's static inputs: the per-step check and copy, and the views it keeps for them."""

from __future__ import annotations

import pytest
import torch

from graphs import inputs as inputs_module
from graphs.inputs import InputSpec, StaticInputs
from planner import BatchError

SPECS = {
    "input_ids": InputSpec(torch.int64, pad=7),
    "embeds": InputSpec(torch.float32, shape=(3,), pad=-1.0),
    "req_ids": InputSpec(torch.int32, per="reqs", pad=5),
}


def _inputs(reqs: int, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (rows,), generator=gen),
        "embeds": torch.randn(rows, 3, generator=gen),
        "req_ids": torch.randint(0, 100, (reqs,), generator=gen, dtype=torch.int32),
    }


def _expected(values: dict, reqs: int, rows: int, padded_reqs: int, padded_rows: int) -> dict:
    out = {}
    for name, spec in SPECS.items():
        n, total = (rows, padded_rows) if spec.per == "rows" else (reqs, padded_reqs)
        pad = torch.full((total - n, *spec.shape), spec.pad, dtype=spec.dtype)
        out[name] = torch.cat([values[name], pad])
    return out


def test_fill_and_fill_checked_write_real_rows_then_padding(monkeypatch):
    """Over many (real, graph) sizes, more than the views kept: each step's buffers hold its
    rows and the pads, whatever the steps before wrote."""
    monkeypatch.setattr(inputs_module, "_CUTS_KEPT", 5)
    static = StaticInputs(SPECS, 8, 16, torch.device("cpu"))
    step = 0
    for padded_reqs in (1, 2, 4, 8):
        padded_rows = 2 * padded_reqs
        for reqs in range(padded_reqs + 1):
            rows = 2 * reqs
            values = _inputs(reqs, rows, seed=step)
            fill = static.fill if step % 2 else static.fill_checked
            if fill is static.fill_checked:
                static.check(values, reqs, rows)
            fill(values, reqs, rows, padded_reqs, padded_rows)
            views = static.views(padded_reqs, padded_rows)
            want = _expected(values, reqs, rows, padded_reqs, padded_rows)
            for name in SPECS:
                assert torch.equal(views[name], want[name]), (name, reqs, padded_reqs)
            assert len(static._cuts) <= 5
            step += 1


def test_check_names_the_first_wrong_input_and_what_is_wrong():
    """Names first, then per input in spec order: not a tensor, then shape, then dtype."""
    static = StaticInputs(SPECS, 8, 16, torch.device("cpu"))
    good = _inputs(2, 4)
    static.check(good, 2, 4)
    cases = [
        ({k: v for k, v in good.items() if k != "embeds"}, "inputs", "do not match"),
        ({**good, "extra": good["input_ids"]}, "inputs", "do not match"),
        ({**good, "input_ids": [1, 2, 3, 4]}, "inputs.input_ids", "not a tensor"),
        ({**good, "embeds": good["embeds"][:, :2]}, "inputs.embeds", "wrong shape"),
        ({**good, "embeds": good["embeds"][:3].double()}, "inputs.embeds", "wrong shape"),
        ({**good, "embeds": good["embeds"].double()}, "inputs.embeds", "wrong dtype"),
        ({**good, "req_ids": good["req_ids"][:1]}, "inputs.req_ids", "wrong shape"),
        (
            {**good, "input_ids": good["input_ids"].int(), "req_ids": 3},
            "inputs.input_ids",
            "wrong dtype",
        ),
    ]
    for bad, field, message in cases:
        with pytest.raises(BatchError, match=message) as err:
            static.check(bad, 2, 4)
        assert err.value.field == field
        with pytest.raises(BatchError, match=message):
            static.fill(bad, 2, 4, 4, 8)
