"""The latency model corrected online from measured steps (policy/drift.py), on constructed timings."""

import logging
import math

import pytest
from test_coserve import LATENCY, LAYOUT, OFF, ON, decoding, state, uncapped_config

from backfill.policy.coserve import CoServePolicy
from backfill.policy.drift import DriftConfig, LatencyDrift
from backfill.policy.latency_model import BatchShape
from backfill.types import SLO


def run_steps(drift: LatencyDrift, start_s: float, seconds: float, step_ms: float, slowdown: float) -> float:
    """Steps of step_ms predicted (times the current factor), measured at slowdown x the profile."""
    t = start_s
    while t < start_s + seconds:
        predicted = drift.factor * step_ms
        t += slowdown * step_ms / 1e3
        drift.observe(t, predicted, slowdown * step_ms)
    return t


def test_factor_follows_a_slowdown_within_seconds_and_returns():
    drift = LatencyDrift()
    t = run_steps(drift, 0.0, 5.0, 20.0, 1.0)
    assert drift.factor == pytest.approx(1.0)
    # Twice as slow: within 2 s of steps the estimates are within 5% of the measured steps.
    t = run_steps(drift, t, 2.0, 20.0, 2.0)
    assert drift.factor == pytest.approx(2.0, rel=0.05)
    assert drift.max_factor_seen == pytest.approx(drift.factor, rel=0.01)
    t = run_steps(drift, t, 3.0, 20.0, 1.0)
    assert drift.factor == pytest.approx(1.0, rel=0.05)


def test_speed_is_in_busy_time_not_in_steps():
    # 100 fast steps move the factor as far as 10 steps ten times as long.
    small, big = LatencyDrift(), LatencyDrift()
    for _ in range(100):
        small.observe(0.0, small.factor * 2.0, 4.0)
    for _ in range(10):
        big.observe(0.0, big.factor * 20.0, 40.0)
    assert small.factor == pytest.approx(big.factor, rel=0.02)
    assert 1.1 < small.factor < 1.5


def test_one_odd_step_moves_little_and_the_factor_is_bounded():
    drift = LatencyDrift(DriftConfig(max_factor=3.0))
    drift.observe(0.0, 10.0, 1000.0)  # a 100x outlier counts as 2x, weighted by its time
    assert drift.factor <= 2.0
    drift.observe(0.0, 10.0, 0.0)     # an untimed step is ignored
    for _ in range(2000):
        drift.observe(0.0, drift.factor * 20.0, 400.0)
    assert drift.factor == pytest.approx(3.0)
    for _ in range(2000):
        drift.observe(0.0, drift.factor * 20.0, 1.0)
    assert drift.factor == pytest.approx(0.5)
    with pytest.raises(ValueError):
        DriftConfig(min_factor=1.5)


def test_a_persisting_drift_is_flagged_once_and_cleared_when_it_ends(caplog):
    drift = LatencyDrift(DriftConfig(flag_after_s=10.0))
    with caplog.at_level(logging.WARNING, logger="backfill.policy.drift"):
        t = run_steps(drift, 0.0, 5.0, 20.0, 2.0)
        assert not drift.needs_reprofile and drift.flags == 0   # a short drift is not flagged
        t = run_steps(drift, t, 10.0, 20.0, 2.0)
        assert drift.needs_reprofile and drift.flags == 1
        t = run_steps(drift, t, 10.0, 20.0, 2.0)
        assert drift.flags == 1                                  # once per drift, not per step
    assert sum("backfill profile" in r.getMessage() for r in caplog.records) == 1
    t = run_steps(drift, t, 5.0, 20.0, 1.0)
    assert not drift.needs_reprofile
    report = drift.report()
    assert report["flags"] == 1 and report["max_factor"] == pytest.approx(2.0, rel=0.05)
    times = [p[0] for p in report["timeline"]]
    assert times == sorted(times) and all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    assert len(times) >= 25


def plan_shape(plan) -> BatchShape:
    shape = BatchShape()
    for item in plan.scheduled:
        shape = shape.plus(item.num_tokens, 40)
    return shape


def test_coserve_budgets_shrink_when_steps_run_slower_than_the_profile():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=100), slo_margin=1.0,
                                                              adapt_margin=False, rider_cost_share=1.0,
                                                              bank_tpot_slack=False, preempt_target_ms=2.0))
    co = state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(200)])
    before = policy.schedule(co)
    assert before.num_tokens > 60          # 100 ms of budget at 20 ms + 1 ms a token past 8
    batch_before = policy.schedule(state(*[decoding(i, OFF) for i in range(200)])).num_tokens
    now = 1.0
    for _ in range(200):                   # the machine runs every step at 2x the profile
        plan = policy.schedule(state(decoding(0, ON, arrival=0.5),
                                     *[decoding(i, OFF) for i in range(200)], now=now))
        measured_ms = 2.0 * LATENCY.estimate_ms(plan_shape(plan))
        policy.observe_step(plan_shape(plan), measured_ms)
        now += measured_ms / 1e3
    assert policy.latency_drift.factor > 1.3
    after = policy.schedule(state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(200)], now=now))
    # The plan now fits the measured machine: at 2x, 100 ms hold what took 50 ms on the profile.
    assert 2.0 * LATENCY.estimate_ms(plan_shape(after)) <= 100.0 * 1.05
    assert after.num_tokens < before.num_tokens / 1.5
    assert math.isclose(policy.correction_for(1) * LATENCY.estimate_ms(BatchShape().plus(1, 40)),
                        2.0 * LATENCY.estimate_ms(BatchShape().plus(1, 40)), rel_tol=0.1)
    # Offline batches shrink too, so a stretch between safepoints still meets the preemption target.
    batch_after = policy.schedule(state(*[decoding(i, OFF) for i in range(200)], now=now)).num_tokens
    assert batch_after < batch_before
