import math

import pytest
from hypothesis import given, settings, strategies as st

from backfill.errors import PolicyInputError
from backfill.policy.gate import (GateConfig, GateDecision, GateState, IterationGate, LifecycleGate,
                                  TimesliceGate, make_gate)

CFG = GateConfig(min_cooldown_s=0.01, max_cooldown_s=1.0)


def decode_request(gate, rid, start_s, steps, step_s=0.020, gap_s=0.005):
    """An online request whose engine reports busy at each step start and idle at each step end,
    like a kernel-level tracker sees it (Valve §4.2: short idle gaps between decode iterations)."""
    t = start_s
    for _ in range(steps):
        gate.on_busy(t, [rid])
        gate.decide(t)
        t += step_s
        gate.on_decode_step(t, [rid])
        gate.on_idle(t)
        gate.decide(t)
        t += gap_s
        gate.decide(t)
    return t


def test_lifecycle_gate_preempts_each_request_once_and_timeslice_every_step():
    valve, timeslice = LifecycleGate(CFG), TimesliceGate(CFG)
    for gate in (valve, timeslice):
        end = decode_request(gate, "r1", 1.0, steps=20)
        decode_request(gate, "r2", end + 5.0, steps=10)
    assert valve.stats.preemptions("r1") == 1 and valve.stats.preemptions("r2") == 1
    assert valve.stats.pauses == 2
    # GPreempt-style: offline wakes in every decode gap, so every step preempts it again.
    assert timeslice.stats.preemptions("r1") == 20 and timeslice.stats.preemptions("r2") == 10
    assert timeslice.stats.max_preemptions_per_request == 20


def test_cooldown_is_twice_the_longest_decode_gap_and_reopen_time_is_exact():
    gate = LifecycleGate(CFG)
    assert gate.cooldown_s == CFG.min_cooldown_s       # nothing measured yet: the floor
    end = decode_request(gate, "r1", 0.0, steps=5, step_s=0.030, gap_s=0.008)
    assert gate.stats.pauses == 1                       # 8 ms idle gaps stay under the 10 ms floor
    assert gate.longest_gap_s == pytest.approx(0.038)   # step time + idle gap, between step ends
    assert gate.cooldown_s == pytest.approx(0.076)
    idle_since = end - 0.008
    decision = gate.decide(end)
    assert decision == GateDecision(open=False, reopen_at_s=pytest.approx(idle_since + 0.076))
    assert not gate.decide(decision.reopen_at_s - 1e-6).open
    assert gate.decide(decision.reopen_at_s).open
    assert gate.state is GateState.OPEN and gate.stats.reopens == 1


def test_busy_during_cooldown_cancels_reopen_without_a_new_preemption():
    gate = LifecycleGate(CFG)
    gate.on_busy(0.0, ["a"])
    gate.on_idle(0.1)
    assert gate.decide(0.105).reopen_at_s == pytest.approx(0.11)
    gate.on_busy(0.106, ["b"])                          # arrives while still closed
    assert gate.decide(0.2) == GateDecision(open=False, reopen_at_s=None)
    assert gate.stats.preemptions("a") == 1 and gate.stats.preemptions("b") == 0
    assert gate.stats.pauses == 1


def test_gaps_between_unrelated_requests_do_not_inflate_the_cooldown():
    gate = LifecycleGate(CFG)
    gate.on_decode_step(0.0, ["a"])
    gate.on_decode_step(0.02, ["a"])
    gate.on_decode_step(5.0, ["b"])                     # new request: not a decode gap
    assert gate.longest_gap_s == pytest.approx(0.02)
    gate.on_decode_step(5.03, ["b", "c"])
    assert gate.longest_gap_s == pytest.approx(0.03)


def test_cooldown_is_clamped_and_forgets_old_gaps():
    gate = LifecycleGate(GateConfig(min_cooldown_s=0.05, max_cooldown_s=0.5, gap_window=3))
    gate.on_decode_step(0.0, ["a"])
    gate.on_decode_step(10.0, ["a"])                    # a 10 s stall
    assert gate.cooldown_s == 0.5
    for i in range(3):
        gate.on_decode_step(10.0 + 0.01 * (i + 1), ["a"])
    assert gate.cooldown_s == 0.05                      # 2 x 10 ms is under the floor


def test_iteration_gate_closes_only_at_the_next_offline_boundary():
    gate = IterationGate(CFG)
    gate.on_busy(1.0, ["r"])
    assert gate.decide(1.0).open and gate.close_pending
    gate.on_offline_iteration_boundary(1.3)
    assert not gate.decide(1.3).open
    assert gate.stats.close_delays_s == [pytest.approx(0.3)]
    assert gate.stats.preemptions("r") == 1
    gate.on_idle(1.5)
    assert gate.decide(1.5).open                        # reopens at once, like the timeslice gate


def test_iteration_gate_never_closes_if_online_finishes_first():
    gate = IterationGate(CFG)
    gate.on_busy(1.0, ["r"])
    gate.on_idle(1.1)
    gate.on_offline_iteration_boundary(1.2)
    assert gate.decide(1.2).open and gate.stats.pauses == 0


def test_valve_and_timeslice_close_without_delay():
    for gate in (LifecycleGate(CFG), TimesliceGate(CFG)):
        gate.on_busy(2.0, ["r"])
        assert not gate.decide(2.0).open
        assert gate.stats.close_delays_s == [0.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.floats(0.001, 0.02), st.floats(0.0, 0.004), st.floats(0.0, 2.0)),
                min_size=1, max_size=8))
def test_at_most_one_preemption_per_request_when_gaps_are_below_the_floor(requests):
    # Valve §4.2's guarantee: idle gaps inside a request shorter than the cooldown never
    # reopen the gate, so each request is preempted at most once.
    gate = LifecycleGate(GateConfig(min_cooldown_s=0.01, max_cooldown_s=1.0))
    t = 0.0
    for i, (steps, step_s, gap_s, pause_s) in enumerate(requests):
        t = decode_request(gate, f"r{i}", t + pause_s, steps, step_s, gap_s)
    assert all(n <= 1 for n in gate.stats.preemptions_by_request.values())
    assert gate.stats.pauses <= len(requests)


def test_make_gate_and_errors():
    assert isinstance(make_gate("valve"), LifecycleGate)
    assert isinstance(make_gate("timeslice"), TimesliceGate)
    assert isinstance(make_gate("iteration"), IterationGate)
    with pytest.raises(PolicyInputError, match="unknown gate"):
        make_gate("nope")
    gate = LifecycleGate()
    gate.decide(5.0)
    with pytest.raises(PolicyInputError, match="earlier"):
        gate.on_busy(4.0, ["r"])
    with pytest.raises(PolicyInputError, match="finite"):
        gate.decide(math.nan)
    with pytest.raises(PolicyInputError, match="str"):
        gate.on_busy(6.0, [3])
    for bad in (dict(cooldown_factor=0.5), dict(min_cooldown_s=2.0, max_cooldown_s=1.0),
                dict(max_cooldown_s=math.inf), dict(gap_window=0)):
        with pytest.raises(PolicyInputError):
            GateConfig(**bad)
