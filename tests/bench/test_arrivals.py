import numpy as np
import pytest

from backfill.bench.arrivals import (cv_from_burstiness, gamma_arrivals, gamma_shape, on_off_arrivals,
                                     parse_arrival_spec, piecewise_arrivals, poisson_arrivals, step_arrivals,
                                     uniform_arrivals)
from backfill.errors import WorkloadError


def _rate_and_cv(times: np.ndarray) -> tuple[float, float]:
    gaps = np.diff(np.concatenate(([0.0], times)))
    return 1.0 / gaps.mean(), gaps.std() / gaps.mean()


@pytest.mark.parametrize("rate,cv,count", [(1.0, 1.0, 20_000), (10.0, 1.0, 20_000), (5.0, 0.5, 5_000),
                                           (2.0, 2.0, 50_000), (8.0, 4.0, 200_000)])
def test_gamma_mean_rate_and_cv_from_seed(rate, cv, count):
    times = gamma_arrivals(rate, cv, seed=7, count=count)
    assert len(times) == count
    assert np.all(np.diff(times) >= 0)
    got_rate, got_cv = _rate_and_cv(times)
    assert got_rate == pytest.approx(rate, rel=0.02)
    assert got_cv == pytest.approx(cv, rel=0.10)


def test_same_seed_same_trace_other_seed_differs():
    a = gamma_arrivals(3.0, 2.0, seed=1, duration_s=100)
    assert np.array_equal(a, gamma_arrivals(3.0, 2.0, seed=1, duration_s=100))
    assert not np.array_equal(a, gamma_arrivals(3.0, 2.0, seed=2, duration_s=100))


def test_poisson_by_duration_stays_inside_and_hits_rate():
    times = poisson_arrivals(20.0, seed=3, duration_s=1000)
    assert times.min() > 0 and times.max() < 1000
    assert len(times) / 1000 == pytest.approx(20.0, rel=0.02)
    assert _rate_and_cv(times)[1] == pytest.approx(1.0, rel=0.10)


def test_burstiness_is_gamma_shape():
    # vLLM --burstiness 0.25 is a gamma shape of 0.25, i.e. cv 2.
    assert cv_from_burstiness(0.25) == pytest.approx(2.0)
    assert gamma_shape(2.0) == pytest.approx(0.25)
    assert gamma_shape(1.0) == 1.0


def test_uniform_is_evenly_spaced():
    times = uniform_arrivals(4.0, duration_s=2.0, offset_s=0.1)
    assert np.allclose(times, [0.1, 0.35, 0.6, 0.85, 1.1, 1.35, 1.6, 1.85])
    assert np.allclose(uniform_arrivals(2.0, count=3), [0.0, 0.5, 1.0])


def test_on_off_has_no_arrivals_off_and_the_rate_on():
    times = on_off_arrivals(50.0, on_s=10.0, off_s=5.0, duration_s=600.0, seed=4)
    phase = times % 15.0
    assert np.all(phase < 10.0)  # nothing in the OFF phases
    on_seconds = 40 * 10.0
    assert len(times) / on_seconds == pytest.approx(50.0, rel=0.02)


def test_on_off_with_background_rate_off():
    times = on_off_arrivals(40.0, on_s=5.0, off_s=5.0, duration_s=1000.0, seed=5, rate_off_per_s=10.0)
    on = times[(times % 10.0) < 5.0]
    off = times[(times % 10.0) >= 5.0]
    assert len(on) / 500 == pytest.approx(40.0, rel=0.03)
    assert len(off) / 500 == pytest.approx(10.0, rel=0.05)


def test_step_changes_of_rate_keep_each_rate_and_cv():
    times = step_arrivals([(0, 10.0), (400, 40.0), (800, 0.0), (900, 20.0)], duration_s=1300, seed=6, cv=2.0)
    counts = [np.sum((times >= a) & (times < b)) for a, b in [(0, 400), (400, 800), (800, 900), (900, 1300)]]
    assert counts[0] / 400 == pytest.approx(10.0, rel=0.1)
    assert counts[1] / 400 == pytest.approx(40.0, rel=0.05)
    assert counts[2] == 0
    assert counts[3] / 400 == pytest.approx(20.0, rel=0.1)
    assert times.max() < 1300
    fast = times[(times >= 400) & (times < 800)]
    gaps = np.diff(fast)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)


def test_all_zero_rates_give_no_arrivals():
    assert len(piecewise_arrivals([(0, 0.0)], 10.0, seed=0)) == 0


@pytest.mark.parametrize("call", [
    lambda: gamma_arrivals(0.0, 1.0, seed=0, count=10),
    lambda: gamma_arrivals(1.0, -1.0, seed=0, count=10),
    lambda: gamma_arrivals(1.0, 1.0, seed=0),
    lambda: gamma_arrivals(1.0, 1.0, seed=0, count=5, duration_s=5),
    lambda: gamma_arrivals(1.0, 1.0, seed=-3, count=5),
    lambda: gamma_arrivals(float("nan"), 1.0, seed=0, count=5),
    lambda: piecewise_arrivals([(1.0, 2.0)], 10.0, seed=0),
    lambda: piecewise_arrivals([(0.0, 2.0), (0.0, 3.0)], 10.0, seed=0),
    lambda: piecewise_arrivals([(0.0, -2.0)], 10.0, seed=0),
    lambda: piecewise_arrivals([], 10.0, seed=0),
    lambda: on_off_arrivals(1.0, 0.0, 1.0, 10.0, seed=0),
    lambda: uniform_arrivals(1.0, duration_s=5, offset_s=-1),
])
def test_bad_parameters_raise(call):
    with pytest.raises(WorkloadError):
        call()


@pytest.mark.parametrize("text", ["poisson:4", "gamma:4:2", "uniform:4", "onoff:8:10:5", "onoff:8:10:5:1@2",
                                  "steps:0=2,60=8,120=0@1.5"])
def test_arrival_spec_round_trip(text):
    assert str(parse_arrival_spec(text)) == text


def test_arrival_spec_generates_like_the_functions():
    assert np.array_equal(parse_arrival_spec("gamma:4:2").generate(3, 50.0),
                          gamma_arrivals(4.0, 2.0, seed=3, duration_s=50.0))
    assert np.array_equal(parse_arrival_spec("onoff:8:10:5:1@2").generate(3, 60.0),
                          on_off_arrivals(8.0, 10.0, 5.0, 60.0, seed=3, cv=2.0, rate_off_per_s=1.0))
    assert np.array_equal(parse_arrival_spec("steps:0=2,30=8").generate(3, 60.0),
                          step_arrivals([(0, 2), (30, 8)], 60.0, seed=3))
    assert np.allclose(parse_arrival_spec("uniform:2").generate(0, 2.0), [0.0, 0.5, 1.0, 1.5])
    assert np.array_equal(parse_arrival_spec("poisson:5").generate(1, 20.0), poisson_arrivals(5.0, 1, duration_s=20))


@pytest.mark.parametrize("text,match", [
    ("poisson", "bad arrival spec"), ("weibull:3", "unknown arrival process"), ("gamma:4", "takes 2"),
    ("poisson:-1", "rate_per_s"), ("poisson:x", "bad number"), ("gamma:4:0", "cv"), ("poisson:4@2", "@CV"),
    ("onoff:8:0:5", "on_s"), ("onoff:8:10:5:-1", "OFF rate"), ("steps:5=2", "start at 0"),
    ("steps:0=2,0=3", "increasing"), ("steps:0-2", "START=RATE"), ("onoff:8:10:5@0", "cv"),
])
def test_bad_arrival_specs(text, match):
    with pytest.raises(WorkloadError, match=match):
        parse_arrival_spec(text)
