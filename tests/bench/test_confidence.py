"""The paired bootstrap of P99 latency ratios."""

import numpy as np
import pytest

from backfill.bench.confidence import paired_values, percentile_ratio_interval
from backfill.bench.metrics import RequestRecord
from backfill.errors import WorkloadError
from backfill.types import RequestClass


def _online(request_id: str, ttft_s: float) -> RequestRecord:
    return RequestRecord(request_id, RequestClass.ONLINE, send_s=0.0, first_token_s=ttft_s,
                         chunk_times_s=[ttft_s, ttft_s + 0.01], chunk_tokens=[1, 1], end_s=ttft_s + 0.01,
                         output_tokens=2)


def test_pairs_online_requests_by_id_and_skips_the_rest():
    base = [_online("a", 0.1), _online("b", 0.2), _online("gone", 0.3)]
    mine = [_online("b", 0.4), _online("a", 0.3), _online("new", 0.5),
            RequestRecord("off", RequestClass.OFFLINE, send_s=0.0, first_token_s=0.1, end_s=0.2, output_tokens=1),
            RequestRecord("c", RequestClass.ONLINE, send_s=0.0, error="boom")]
    values, baseline = paired_values(mine, base, lambda r: r.ttft_ms)
    np.testing.assert_allclose(values, [400.0, 300.0])
    np.testing.assert_allclose(baseline, [200.0, 100.0])


def test_interval_brackets_the_ratio_and_narrows_with_more_requests():
    rng = np.random.default_rng(1)
    widths = []
    for n in (50, 2000):
        baseline = rng.lognormal(4.0, 0.5, n)
        values = baseline * 1.2
        iv = percentile_ratio_interval(values, baseline)
        assert iv.ratio == pytest.approx(1.2) and iv.low == pytest.approx(1.2) and iv.high == pytest.approx(1.2)
        noisy = percentile_ratio_interval(baseline * rng.lognormal(0.0, 0.2, n), baseline)
        assert noisy.low <= noisy.ratio <= noisy.high and noisy.pairs == n
        widths.append(noisy.high - noisy.low)
    assert widths[1] < widths[0]


def test_same_seed_same_interval():
    rng = np.random.default_rng(2)
    a, b = rng.random(100) + 0.5, rng.random(100) + 0.5
    assert percentile_ratio_interval(a, b, seed=7) == percentile_ratio_interval(a, b, seed=7)


@pytest.mark.parametrize("values, baseline, kwargs", [
    (np.ones(3), np.ones(4), {}),                      # not paired
    (np.ones(1), np.ones(1), {}),                      # too few
    (np.ones(5), np.zeros(5), {}),                     # no ratio to a zero baseline
    (np.ones(5), np.ones(5), {"level": 1.0}),
    (np.ones(5), np.ones(5), {"percentile": 0.0}),
    (np.ones(5), np.ones(5), {"resamples": 0}),
])
def test_bad_input_is_a_typed_error(values, baseline, kwargs):
    with pytest.raises(WorkloadError):
        percentile_ratio_interval(values, baseline, **kwargs)
