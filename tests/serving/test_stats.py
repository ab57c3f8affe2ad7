"""The scheduler's counters: bounded memory however many preemptions a server sees."""

from __future__ import annotations

from backfill.serving.stats import KEPT_EVENTS, PREEMPTION_LATENCY_BOUNDS_MS, PreemptionRecord, SchedulerStats


def test_preemption_histogram_is_incremental_and_events_are_bounded():
    stats = SchedulerStats()
    latencies = [0.5, 1.0, 3.0, 7.0, 499.0, 900.0] * ((KEPT_EVENTS // 6) + 100)
    for i, latency_ms in enumerate(latencies):
        stats.record_preemption(PreemptionRecord(float(i), latency_ms, 0.1, 3, 16))
    assert len(stats.preemption_events) == KEPT_EVENTS           # the newest kept, no more
    assert stats.preemption_events[-1].at_s == len(latencies) - 1
    cumulative = stats.preemption_latency_ms.cumulative()
    assert len(cumulative) == len(PREEMPTION_LATENCY_BOUNDS_MS) + 1
    for bound, count in zip(PREEMPTION_LATENCY_BOUNDS_MS, cumulative):
        assert count == sum(1 for v in latencies if v <= bound)  # every event ever, not the kept ones
    assert cumulative[-1] == len(latencies)
    assert abs(stats.preemption_latency_ms.total - sum(latencies)) < 1e-6 * sum(latencies)
