"""The Triton sparse MLA decode kernel compiled for the GPU, against its references, on CUDA.

Skipped cleanly without CUDA. The checks are those of ``benchmarks/kernels/sparse_mla.py``
(one source of truth) at the real shape over fewer batches: the split plan bit-equal to
its torch reference, one capture of plan + kernel replayed over fresh batches bit-equal to
eager calls, and the error against the fp32 reference within 2e-2 for every config.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends.nsa.sparse_mla_plan import CONFIGS  # noqa: E402
from benchmarks.kernels import sparse_mla as bench  # noqa: E402

DEV = torch.device("cuda")
SMS = torch.cuda.get_device_properties(DEV).multi_processor_count


def _args(**change):
    args = bench.parse_args(["--rows", "1", "5", "16", "--slots", "65536", "--batches", "12"])
    for k, v in change.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def kv():
    return bench.make_kv(_args(), DEV, torch.Generator().manual_seed(0))


def test_split_plan_triton_is_bit_equal_on_cuda():
    result = bench.check_plans(_args(), DEV, torch.Generator().manual_seed(1))
    assert result["mismatches"] == 0


def test_captured_plan_and_kernel_replay_equal_eager(kv):
    result = bench.check_replay(_args(), DEV, torch.Generator().manual_seed(2), kv, CONFIGS[0], SMS)
    assert result["mismatches"] == 0 and result["replays"] == 8


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_every_config_is_within_tolerance(kv, index):
    acc = bench.accuracy(_args(), DEV, torch.Generator().manual_seed(3), kv, CONFIGS[index], SMS)
    assert not acc["failures"], acc
    assert acc["max_rel_err"] < 2e-2
