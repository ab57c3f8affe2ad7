"""The engine benchmark's floors: each decode figure carries the bandwidth measured around it."""

import pytest

from backfill.bench import engine_bench


def test_adjacent_floor_uses_the_higher_of_the_readings_around_the_measurement(monkeypatch):
    readings = iter([20.0, 25.0])
    calls = []
    monkeypatch.setattr(engine_bench, "measure_device_bandwidth_gbs", lambda device: next(readings))
    d = engine_bench._with_adjacent_floor(lambda: calls.append("measured") or {"tpot_ms": 10.0},
                                          weight_bytes=100_000_000, device="cpu")
    assert calls == ["measured"]
    # 100 MB at 25 GB/s is 4 ms: the lower floor, so the ratio errs against the engine.
    assert d["adjacent_read_bandwidth_gbs"] == 25.0
    assert d["adjacent_floor_ms"] == pytest.approx(4.0)
    assert d["tpot_over_adjacent_floor"] == pytest.approx(2.5)


@pytest.mark.slow
def test_engine_bench_reports_both_floors_for_each_batch():
    result = engine_bench.run_engine_bench(dtypes=("float32",), batches=(1, 2), prompt_len=16, new_tokens=4,
                                           with_hf=False, random_weights=True, log=lambda *_: None)
    run = result["runs"]["float32"]
    assert result["read_bandwidth_gbs"] > 0 and run["bandwidth_floor_ms"] > 0
    assert [d["batch"] for d in run["decode"]] == [1, 2]
    for d in run["decode"]:
        assert d["tpot_ms"] > 0 and d["adjacent_read_bandwidth_gbs"] > 0
        assert d["tpot_over_floor"] == pytest.approx(d["tpot_ms"] / run["bandwidth_floor_ms"])
        assert d["tpot_over_adjacent_floor"] == pytest.approx(d["tpot_ms"] / d["adjacent_floor_ms"])
