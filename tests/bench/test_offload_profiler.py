"""AQUA §4.1's rate search: binary search, then linear steps to a local maximum."""

import pytest

from backfill.errors import WorkloadError
from backfill.bench.offload_profiler import Probe, find_max_rate


def engine_with_capacity(capacity: float, calls: list[float]):
    def measure(rate: float) -> Probe:
        calls.append(rate)
        return Probe(rate, 100 * rate, 10.0, rate <= capacity, min(1.0, rate / 4))
    return measure


@pytest.mark.parametrize("capacity", [0.3, 1.1, 2.6, 3.9])
def test_finds_the_highest_rate_within_the_sla_to_one_linear_step(capacity):
    calls = []
    best, probes = find_max_rate(engine_with_capacity(capacity, calls), 0.25, 4.0, binary_steps=3, step=0.25)
    assert best.meets_sla and best.rate_per_s <= capacity < best.rate_per_s + 0.25 + 1e-9 or capacity >= 4.0
    assert calls[:2] == [0.25, 2.125]            # lo, then the first midpoint
    assert len(probes) == len(calls) <= 1 + 3 + 4


def test_nothing_sustainable():
    best, probes = find_max_rate(engine_with_capacity(0.1, []), 0.25, 4.0)
    assert best is None and len(probes) == 1


def test_bad_range():
    with pytest.raises(WorkloadError):
        find_max_rate(engine_with_capacity(1, []), 2.0, 1.0)
