"""The producer's throughput from short windows, and where its time went, on constructed report
rows (the producer engine's cumulative counters) and a constructed /proc/stat."""

import pytest

from backfill.errors import WorkloadError
from backfill.bench import producer_meter
from backfill.bench.producer import thread_schedstat


def rows(rates, period_s=0.5, step_ms=2.0, wait_share=0.0, core=None):
    """Report rows every period_s at these tokens/s (one per period), each step 1 token."""
    out, tokens, steps, run, wait, t = [], 0.0, 0.0, 0.0, 0.0, 100.0
    busy = 0.0
    for k, rate in enumerate([rates[0]] + list(rates)):
        if k:
            tokens += rate * period_s
            steps += rate * period_s
            run += rate * period_s * step_ms / 1e3
            wait += wait_share * period_s
            busy += period_s * (core or 0.0) + rate * period_s * step_ms / 1e3
            t += period_s
        row = {"t": t, "tokens": tokens, "steps": steps, "run_s": run, "wait_s": wait}
        if core is not None:
            row["core"] = {"busy_s": busy, "nice_s": 0.1 * period_s * k, "steal_s": 0.0}
        out.append(row)
    return out


def test_one_second_windows_and_their_median_resists_a_spike():
    # 20 half-second reports at 100 tok/s, except two (one second) at 10 tok/s.
    rates = [100.0] * 20
    rates[6] = rates[7] = 10.0
    ws = producer_meter.windows(rows(rates), 0.0, 1e9)
    assert len(ws) == 10 and all(w.wall_s == pytest.approx(1.0) for w in ws)
    s = producer_meter.summarize(ws)
    assert s["windows"] == 10
    assert s["tokens_per_s"] == pytest.approx(100.0)      # the mean would say 91
    assert min(w.tokens_per_s for w in ws) == pytest.approx(10.0)


def test_windows_stay_inside_the_time_window():
    r = rows([50.0] * 20)                # t from 100 to 110
    ws = producer_meter.windows(r, 102.0, 106.0)
    assert len(ws) == 4 and ws[0].t == pytest.approx(102.0)
    assert producer_meter.windows(r, 200.0, 300.0) == []
    with pytest.raises(WorkloadError):
        producer_meter.windows(r, 0.0, 1e9, width_s=0)


def test_where_the_time_went():
    # 100 tok/s, 4 ms of compute a step: 40% of the core; runnable but waiting 20% of the time;
    # other work took 30% of the core beside the producer's own 40%.
    ws = producer_meter.windows(rows([100.0] * 8, step_ms=4.0, wait_share=0.2, core=0.3), 0.0, 1e9)
    s = producer_meter.summarize(ws)
    assert s["step_ms"] == pytest.approx(10.0)
    assert s["run_ms_per_step"] == pytest.approx(4.0)
    assert s["wait_share"] == pytest.approx(0.2)
    assert s["core_other_share"] == pytest.approx(0.3)
    assert s["nice_share"] == pytest.approx(0.1)
    assert s["steal_share"] == pytest.approx(0.0)
    assert s["tokens_per_s_q1_q3"] == pytest.approx([100.0, 100.0])


def test_rows_without_counters_give_rates_only():
    r = [{"t": 10.0 + 0.5 * k, "tokens": 20 * k} for k in range(5)]
    s = producer_meter.summarize(producer_meter.windows(r, 0.0, 1e9))
    assert s["tokens_per_s"] == pytest.approx(40.0)
    assert s["step_ms"] is None and s["wait_share"] is None and s["core_other_share"] is None
    assert producer_meter.summarize([])["tokens_per_s"] is None


def test_core_times_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 1 2 3 4 5 6 7 8 0 0\n"
                    "cpu1 100 50 10 1000 3 2 1 40 0 0\n")
    tick = producer_meter._TICK_S
    got = producer_meter.core_times(1, str(stat))
    assert got == pytest.approx({"busy_s": 163 * tick, "nice_s": 50 * tick, "steal_s": 40 * tick})
    assert producer_meter.core_times(7, str(stat)) is None
    assert producer_meter.core_times(0, str(tmp_path / "missing")) is None


def test_loss():
    assert producer_meter.loss(95.0, 100.0) == pytest.approx(0.05)
    assert producer_meter.loss(None, 100.0) is None and producer_meter.loss(95.0, 0.0) is None


def test_the_producer_reads_its_own_thread_times():
    run0, _ = thread_schedstat()
    x = 0
    for i in range(2_000_000):
        x += i
    run1, wait1 = thread_schedstat()
    assert wait1 >= 0.0
    if run0 or run1:                     # Linux with schedstat
        assert run1 > run0
