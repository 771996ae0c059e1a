"""The run's timings stay bounded: the latest values for percentiles, the mean of all."""

from __future__ import annotations

import pytest

from dsv32_engine.serving.samples import Samples


def test_keeps_every_value_until_full():
    samples = Samples(capacity=4)
    for v in (1.0, 2.0, 3.0):
        samples.append(v)
    assert list(samples) == [1.0, 2.0, 3.0] and len(samples) == 3 and samples.count == 3
    assert samples.mean == pytest.approx(2.0) and samples[1:] == [2.0, 3.0]


def test_then_the_latest_oldest_first_and_the_mean_of_all():
    samples = Samples(capacity=3)
    for v in range(10):
        samples.append(float(v))
    assert list(samples) == [7.0, 8.0, 9.0] and len(samples) == 3
    assert samples.count == 10 and samples.mean == pytest.approx(4.5)
    assert sorted(samples) == [7.0, 8.0, 9.0]


def test_empty():
    samples = Samples()
    assert list(samples) == [] and samples.mean == 0.0 and not samples
