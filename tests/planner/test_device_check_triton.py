"""The fused device check (two Triton kernels) equals its torch reference bit for bit: the
error word and every source field, on random batches with every kind of fault, uniform and
ragged, clean and with an error word already set. Runs under ``TRITON_INTERPRET=1`` on the
CPU and compiled on a GPU."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from planner import ForwardMode
from planner.device_checks import InputCheck, Refusal
from planner.staging import input_bounds
from planner.step_inputs import InputLayout, StepInputs
from tests.support import REPO
from tests.support.kernels import DEVICE

pytestmark = pytest.mark.triton(device=DEVICE)

MAX_REQS, MAX_TOKENS, CONTEXT, ROWS, PAGE = 12, 40, 64, 20, 8
KV_SLOTS = ROWS * CONTEXT
FAULTS = (None, "prefix", "range", "tokens", "kv", "slot", "request", "positions", "table")


def _table(rng: random.Random) -> torch.Tensor:
    slots = list(range(1, KV_SLOTS))
    rng.shuffle(slots)
    table = torch.tensor(slots[: ROWS * CONTEXT - 0] + [0], dtype=torch.int32)[: ROWS * CONTEXT]
    return table.view(ROWS, CONTEXT).clone()


def _fill(inputs: StepInputs, table: torch.Tensor, rng: random.Random, mode, reqs, tokens, fault):
    """A valid batch of at most ``reqs`` requests and ``tokens`` tokens, then ``fault``."""
    ragged = mode.ragged
    n = rng.randint(1, reqs)
    if ragged:
        new = [1] * n
        for _ in range(rng.randint(0, tokens - n)):
            new[rng.randrange(n)] += 1
    else:
        new = [1] * n
    lens = [rng.randint(e, CONTEXT) for e in new]
    pools = rng.sample(range(1, ROWS), n)
    slots, positions = [], []
    for p, length, e in zip(pools, lens, new):
        for q in range(length - e, length):
            slots.append(int(table[p, q]))
            positions.append(q)
    t = len(slots)
    given = rng.random() < 0.7 or fault == "positions"
    if fault == "prefix" and ragged:
        new[0] = lens[0] + 1
    elif fault == "range":
        which = rng.choice(["seq", "pool", "slot", "pos"])
        if which == "seq":
            lens[rng.randrange(n)] = CONTEXT + 5
        elif which == "pool":
            pools[rng.randrange(n)] = ROWS + 3
        elif which == "slot":
            slots[rng.randrange(t)] = -7
        else:
            given = True
            positions[rng.randrange(t)] = CONTEXT + 1
    elif fault == "tokens" and ragged:
        new[rng.randrange(n)] += 1
    elif fault == "slot" and t > 1:
        i, j = rng.sample(range(t), 2)
        slots[j] = slots[i]
    elif fault == "request" and n > 1:
        i, j = rng.sample(range(n), 2)
        pools[j] = pools[i]
    elif fault == "positions":
        positions[rng.randrange(t)] += 1
    elif fault == "table":
        b = rng.randrange(n)
        table[pools[b], rng.randrange(lens[b])] = rng.choice([-3, KV_SLOTS + 9])
    inputs.seq_lens[:n] = lens
    inputs.extend_lens[:n] = new
    inputs.req_pool_indices[:n] = pools
    inputs.out_cache_loc[:t] = slots
    inputs.positions[:t] = positions
    # junk past the real rows: the check must never read it as real
    inputs.seq_lens[n:] = rng.randint(-9, 999)
    inputs.out_cache_loc[t:] = rng.randint(-9, 999)
    inputs.set_counts(n, t, positions_given=given)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("seed", range(6))
def test_the_fused_check_equals_the_reference(mode, seed):
    rng = random.Random(seed)
    device = DEVICE
    tokens_cap = MAX_TOKENS if mode.ragged else MAX_REQS
    layout = InputLayout(MAX_REQS, tokens_cap)
    seen = set()
    for trial in range(12):
        table = _table(rng).to(device)
        kv_bound = rng.choice([None, 200]) if mode.ragged else None
        bounds = input_bounds(mode, CONTEXT, 1, KV_SLOTS, table, kv_bound)
        check = InputCheck(
            layout, bounds, device, ident=3, fused=True, per_bucket=rng.random() < 0.5
        )
        assert check.fused
        reqs = rng.randint(1, MAX_REQS)
        tokens = rng.randint(reqs, tokens_cap) if mode.ragged else reqs
        host = torch.zeros(layout.size, dtype=torch.int32)
        inputs = StepInputs(host, layout, mode)
        fault = FAULTS[(seed * 12 + trial) % len(FAULTS)]
        _fill(inputs, table, rng, mode, reqs, tokens, fault)
        region = host.to(device)
        sticky = rng.random() < 0.15
        words, fields = [], []
        for run in (check.reference, check.run):
            error = torch.zeros(8, dtype=torch.int32, device=device)
            if sticky:
                error[:] = torch.tensor([2, 0, 1, 99, 99, 99, 3, 0])
            outputs = {
                (source, pad): torch.full(
                    (tokens if per else reqs,), -77, dtype=torch.int32, device=device
                )
                for source, per in (
                    ("seq_lens", False),
                    ("extend_lens", False),
                    ("req_pool_indices", False),
                    ("out_cache_loc", True),
                    ("positions", True),
                )
                for pad in (0, 1)
                if pad == 0 or source in ("seq_lens", "req_pool_indices", "out_cache_loc")
            }
            run(region, reqs, tokens, table, error, outputs)
            words.append(error.tolist())
            fields.append({key: out.tolist() for key, out in outputs.items()})
        assert words[0] == words[1], (fault, words)
        assert fields[0] == fields[1], fault
        seen.add(Refusal(words[0][0]))
    assert len(seen) >= 2, "the faults produced no refusal at all: the test proves nothing"


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from planner import device_checks_triton as m

table_rows, check = m.kernels()
for fn, consts in (
    (table_rows, {"BLOCK": m.BLOCK_W}),
    (check, dict(TOKENS_GIVEN=%s, KV_BOUND=%s, N_OUT=%d, BLOCK_R=%d, BLOCK_T=%d)),
):
    consts = {**consts, "BIG": m.BIG}
    names = fn.arg_names
    signature = {
        n: "constexpr" if n in consts else "*i32" if n.endswith("_ptr") else "i32" for n in names
    }
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
print("compiled")
"""


@pytest.mark.parametrize(
    "constexprs", [(True, True, 5, 16, 128), (False, False, 8, 256, 64)], ids=["ragged", "uniform"]
)
def test_the_kernels_compile_for_hopper(constexprs):
    """The interpreter runs Python that Triton's compiler refuses (a plain module global in a
    kernel, a loop variable changing shape): both kernels compile to an sm90 cubin, without a
    GPU, in a process of their own (the interpreter off, as on a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", COMPILE % constexprs],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
