"""The example plugin's tests: what every backend package should check, with the library's
helpers (``planner.testing``, ``graphs.GraphRunner`` on the CPU, the dump API).

- its providers write exactly what the torch reference writes, every output, every element;
- the reference means what its docstring says (here: every KV block scheduled once);
- every phase (eager, capture, record, replay) gives the same plans, checked bit for bit
  by debug mode on each replay, under the CPU's emulated graph (which refuses host syncs
  in captured ops, so a provider that would break a real CUDA graph fails here);
- bad options are refused at planner build, naming the option;
- plans dump and load back.
"""

from __future__ import annotations

import random
from importlib.metadata import entry_points

import pytest
import torch
from fp_example_mla import MLADecodePlan
from fp_example_mla.ops import mla_metadata

from graphs import GraphRunner
from planner import ConfigError, ForwardMode, Limits, Planner, SchemaError
from planner.dumps import dump_plans, load_dump
from planner.registry import ENTRY_POINT_GROUP, backend_plans
from planner.testing import check_provider, random_batch, token_table

I32 = torch.int32
MAX_BATCH, MAX_CONTEXT = 8, 512


def planner(**kwargs) -> Planner:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, num_sms=16, next_n=2)
    return Planner(["example-mla"], limits, **kwargs)


def random_lens(rng: random.Random) -> torch.Tensor:
    reqs = rng.randint(1, 40)
    return torch.tensor([rng.randint(1, 5000) for _ in range(reqs)], dtype=I32)


def test_the_entry_point_finds_the_backend():
    if not any(ep.name == "example-mla" for ep in entry_points(group=ENTRY_POINT_GROUP)):
        pytest.skip("fp-example-mla is not installed (pip install -e examples/plugin)")
    assert backend_plans("example-mla") == [MLADecodePlan]


@pytest.mark.parametrize("provider", sorted(mla_metadata.providers))
def test_each_provider_writes_what_the_reference_writes(provider):
    rng = random.Random(provider)
    for seed in range(100):
        lens = random_lens(rng)
        parts, block_n = rng.randint(1, 140), rng.choice([16, 64])
        outputs = [((parts, 8), I32), ((lens.shape[0] + 1,), I32)]
        check_provider(mla_metadata, provider, outputs, [lens], {"block_n": block_n}, seed=seed)


def test_the_schedule_covers_every_kv_block_once():
    rng = random.Random(0)
    for _ in range(100):
        lens = random_lens(rng)
        parts, block_n = rng.randint(1, 140), rng.choice([16, 64])
        tile = torch.empty(parts, 8, dtype=I32)
        offsets = torch.empty(lens.shape[0] + 1, dtype=I32)
        mla_metadata.providers["torch"].fn(tile, offsets, lens, block_n=block_n)
        covered = {r: [] for r in range(lens.shape[0])}
        for begin, begin_pos, end, end_pos, split, *zeros in tile.tolist():
            assert zeros == [0, 0, 0]
            for r in range(begin, end + 1):
                lo = begin_pos if r == begin else 0
                hi = end_pos if r == end else int(lens[r])
                covered[r].append((lo, hi))
            if begin <= end:
                assert split == len(covered[begin]) - 1  # its index among begin's splits
        for r, spans in covered.items():
            assert spans[0][0] == 0 and spans[-1][1] == int(lens[r])
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
            assert int(offsets[r + 1] - offsets[r]) == len(spans)
        assert int(offsets[0]) == 0


def test_every_phase_gives_the_same_plans_on_the_cpu():
    """GraphRunner captures each batch size in an emulated graph; debug mode checks every
    replay bit for bit against a fresh eager plan, padding rows included."""
    table = token_table(MAX_BATCH, MAX_CONTEXT)
    p = planner(debug=True)

    def forward(inputs, plans):
        plan = plans["example-mla"]
        return (plan.num_splits[1:] - plan.num_splits[:-1]).float()  # splits per request

    runner = GraphRunner(p, forward, req_to_token=table, use_cuda_graph=False)
    rng = random.Random(1)
    for step in range(40):
        next_n = 2 if step % 4 == 3 else 1
        batch = random_batch(
            rng, table, max_context=MAX_CONTEXT, bs=rng.randint(1, MAX_BATCH), next_n=next_n
        )
        got = runner.step(batch)
        size, _ = runner.route(batch.mode, batch.bs)  # the captured size it was padded to
        eager = p.plan(batch, pad_to=size)["example-mla"]  # padding requests take blocks too
        splits = (eager.num_splits[1:] - eager.num_splits[:-1]).float()
        assert torch.equal(got, splits[: batch.bs])
    assert not runner.stats.eager and sum(runner.stats.replays.values()) == 40
    assert p.stats.verified == 40
    assert set(runner.stats.captured) == {ForwardMode.DECODE.value, ForwardMode.TARGET_VERIFY.value}
    assert p.stats.op_calls_per_batch(ForwardMode.DECODE)["mla_metadata"] == 1


@pytest.mark.parametrize(
    ("options", "error", "field"),
    [
        ({"num_heads_q": 100, "num_heads_k": 3}, SchemaError, "example-mla.num_heads_q"),
        ({"pad_len": 0}, SchemaError, "example-mla.pad_len"),
        ({"block_n": "64"}, ConfigError, "example-mla.block_n"),
        ({"sm_parts": 4}, SchemaError, "example-mla.sm_parts"),  # derived: not an option
        ({"page_size": 16}, ConfigError, "example-mla.page_size"),  # a limit
    ],
)
def test_bad_options_are_refused_at_build_naming_the_option(options, error, field):
    with pytest.raises(error) as info:
        planner(options={"example-mla": options})
    assert info.value.field == field


def test_a_dump_loads_back(tmp_path):
    table = token_table(MAX_BATCH, MAX_CONTEXT)
    batch = random_batch(random.Random(2), table, max_context=MAX_CONTEXT, bs=3)
    plans = planner().plan(batch)
    loaded = load_dump(dump_plans(plans, tmp_path / "dump", batch=batch, label="example"))
    dumped = loaded.plans()["example-mla"]
    for name, tensor in plans["example-mla"].tensors().items():
        assert torch.equal(dumped.tensors()[name], tensor), name
    assert dumped.scalars()["sm_parts"] == plans["example-mla"].sm_parts
