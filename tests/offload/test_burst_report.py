"""The burst benchmark's scenario and report, on constructed request records."""

import pytest

from backfill.bench.metrics import RequestRecord
from backfill.errors import WorkloadError
from backfill.offload.burst import BurstScenario, ModeRound, format_table, report
from backfill.serving.api import RequestClass


def records(ttft_s: float, n: int = 20) -> list[RequestRecord]:
    out = []
    for i in range(n):
        send = float(i)
        first = send + ttft_s * (i + 1) / n
        out.append(RequestRecord(f"r{i}", RequestClass.ONLINE, "online", send, send, first,
                                 [first, first + 0.5], [1, 9], first + 0.5, 32, 10))
    return out


def test_ratios_and_producer_loss():
    scenario = BurstScenario(steady_s=5, burst_s=10, after_s=5)
    parts = {mode: [ModeRound(records(ttft), 25.0, (0.0, 25.0), {"producer_tokens_per_s": rate, "pages_out": 3})]
             for mode, ttft, rate in (("fcfs", 10.0, 100.0), ("cfs-host", 1.0, 100.0), ("cfs-lent", 0.5, 97.0))}
    result = report(scenario, parts)
    assert result["modes"]["cfs-lent"]["p99_ttft_vs_fcfs"] == pytest.approx(0.05, rel=1e-6)
    assert result["modes"]["cfs-host"]["p99_ttft_vs_fcfs"] == pytest.approx(0.1, rel=1e-6)
    assert result["producer_throughput_loss"] == pytest.approx(0.03)
    assert result["modes"]["fcfs"]["burst_ttft_ms"]["count"] == 10  # sent in [5, 15)
    table = format_table(result)
    assert "cfs-lent: P99 TTFT 0.050x FCFS's (1/20.0)" in table and "3.0%" in table


def test_scenario_errors_and_arrivals():
    with pytest.raises(WorkloadError):
        BurstScenario(burst_factor=0)
    with pytest.raises(WorkloadError):
        BurstScenario(output_len="nope")
    arrivals = BurstScenario(steady_rate_per_s=2.0, steady_s=50, burst_s=50, after_s=50).arrivals(0)
    steady, burst = ((arrivals < 50).sum(), ((arrivals >= 50) & (arrivals < 100)).sum())
    assert 1.5 < burst / steady < 2.6
