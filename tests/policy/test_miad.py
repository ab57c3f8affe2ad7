import random

import pytest

from backfill.errors import PolicyInputError
from backfill.policy.miad import MIADConfig, MIADReservation


def cfg(**kw):
    base = dict(target_events_per_min=2.0, initial_headroom_handles=4, initial_interval_s=10.0,
                min_interval_s=1.0, max_interval_s=100.0, interval_step_s=1.0, rate_window_s=60.0)
    base.update(kw)
    return MIADConfig(**base)


def test_pressure_multiplies_headroom_until_relieved_and_counts_one_event_per_excursion():
    m = MIADReservation(cfg())
    assert m.observe(0.0, used_handles=5, granted_handles=10) == 4       # 50%: no pressure
    assert m.observe(1.0, used_handles=9, granted_handles=10) == 8       # 90%: x2
    assert m.observe(2.0, used_handles=10, granted_handles=10) == 16     # still above: x2 again
    assert m.pressure_events == 1                                       # ... in the same excursion
    assert m.observe(3.0, used_handles=10, granted_handles=26) == 16     # relieved: growth stops
    assert m.observe(4.0, used_handles=24, granted_handles=26) == 32     # a new excursion
    assert m.pressure_events == 2


def test_zero_headroom_still_grows_and_max_is_respected():
    m = MIADReservation(cfg(initial_headroom_handles=0, max_headroom_handles=3))
    assert m.observe(0.0, 1, 1) == 1
    for i in range(4):
        m.observe(1.0 + 2 * i, 0, 1)
        m.observe(2.0 + 2 * i, 1, 1)
    assert m.headroom_handles == 3


def test_additive_decrease_one_handle_per_interval_without_pressure():
    m = MIADReservation(cfg(initial_headroom_handles=5, min_headroom_handles=1,
                            initial_interval_s=10.0, min_interval_s=10.0))
    assert m.advance(9.9) == 5
    assert m.advance(10.0) == 4
    assert m.advance(35.0) == 2
    assert m.advance(1000.0) == 1                                       # floor


def test_no_decrease_while_under_pressure():
    m = MIADReservation(cfg(initial_interval_s=10.0, min_interval_s=10.0))
    m.observe(0.0, 9, 10)
    m.observe(50.0, 10, 10)                                             # still above 90%: grows
    h = m.headroom_handles
    assert h == 16
    m.observe(55.0, 1, 10)                                              # pressure gone at 55 s
    assert m.advance(64.9) == h
    assert m.advance(65.0) == h - 1


def test_interval_grows_once_per_period_with_new_events_and_shrinks_each_quiet_period():
    m = MIADReservation(cfg(target_events_per_min=2.0, initial_interval_s=50.0, max_interval_s=1000.0,
                            control_period_s=5.0, interval_step_s=1.0))
    for i in range(3):                                                  # a burst: 3 events in 5 s
        m.observe(2.0 * i, 9, 10)
        m.observe(2.0 * i + 1, 0, 10)
    # Younger than its window, the controller judges the rate over max(elapsed, 60 s / target).
    assert m.events_per_min(5.0) == 3 * 60 / 30
    m.advance(5.0)
    assert m.release_interval_s == 100.0                                # one increase for the burst
    # The events stay in the window (rate above target) but are not new: the interval holds
    # instead of compounding every period.
    m.advance(55.0)
    assert m.release_interval_s == 100.0
    # At 60 s the first event leaves the 60 s window (2/min, not above): each tick takes 1 s off.
    m.advance(80.0)                                                     # ticks at 60, 65, ... 80
    assert m.release_interval_s == 100.0 - 5
    assert m.events_per_min(80.0) == 0.0


def test_a_single_event_at_start_is_not_over_target():
    m = MIADReservation(cfg(target_events_per_min=2.0, initial_interval_s=10.0, control_period_s=5.0))
    m.observe(1.0, 9, 10)
    assert m.events_per_min(5.0) == 2.0
    m.advance(5.0)
    assert m.release_interval_s == 9.0                                  # at target: additive decrease


def test_an_allocation_the_headroom_misses_counts_as_an_event_inside_an_excursion():
    m = MIADReservation(cfg(initial_headroom_handles=2))
    m.observe(0.0, 9, 10)
    m.observe(1.0, 12, 12)                                              # same excursion, headroom held
    assert m.pressure_events == 1
    m.observe(2.0, 20, 20, headroom_missed=True)                        # outgrew it: offline pays again
    assert m.pressure_events == 2


def _simulate(target_per_min, seed=0, minutes=240):
    """Online demand: a base of ~40 handles plus random bursts of 2-20 handles lasting 2-10 s.
    Each second the online engine is granted what it uses plus the headroom MIAD asks for; a
    burst beyond the grant is capped there (that is when the pool would reclaim)."""
    rng = random.Random(seed)
    m = MIADReservation(MIADConfig(target_events_per_min=target_per_min, initial_headroom_handles=2,
                                   initial_interval_s=5.0, min_interval_s=0.5, max_interval_s=600.0))
    granted, headroom_sum, burst_left, burst = 42, 0, 0, 0
    for t in range(minutes * 60):
        if burst_left == 0 and rng.random() < 0.05:
            burst_left, burst = rng.randint(2, 10), rng.randint(2, 20)
        demand = 40 + rng.randint(-2, 2) + (burst if burst_left else 0)
        burst_left = max(0, burst_left - 1)
        used = min(demand, granted)
        headroom = m.observe(float(t), used, granted)
        granted = used + headroom
        headroom_sum += headroom
    return m.pressure_events / minutes, headroom_sum / (minutes * 60)


def test_closed_loop_event_rate_tracks_the_target():
    results = {target: _simulate(target) for target in (1.0, 2.0, 4.0, 8.0)}
    rates = [results[t][0] for t in sorted(results)]
    headrooms = [results[t][1] for t in sorted(results)]
    # A lower target buys fewer pressure events with more reserved memory.
    assert rates == sorted(rates) and headrooms == sorted(headrooms, reverse=True)
    for target in (2.0, 4.0, 8.0):
        assert target / 2 <= results[target][0] <= target * 1.5, results


def test_errors():
    m = MIADReservation(cfg(), now_s=5.0)
    with pytest.raises(PolicyInputError, match="earlier"):
        m.observe(4.0, 1, 2)
    with pytest.raises(PolicyInputError, match="used <= granted"):
        m.observe(6.0, 3, 2)
    with pytest.raises(PolicyInputError, match="finite"):
        m.advance(float("inf"))
    for bad in (dict(target_events_per_min=0), dict(pressure_threshold=1.5), dict(increase_factor=1.0),
                dict(min_interval_s=20.0), dict(initial_headroom_handles=-1), dict(rate_window_s=0),
                dict(control_period_s=0)):
        with pytest.raises(PolicyInputError):
            cfg(**bad)
