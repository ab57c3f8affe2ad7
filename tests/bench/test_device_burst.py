"""The device burst driver end to end on the CPU (a tiny shape; the GPU run uses the same code)."""

import pytest

from backfill.bench.device_burst import DeviceBurstConfig, format_table, run_device_burst, summarize
from backfill.errors import WorkloadError


def test_summary_counts_burst_arrivals_and_unfinished_requests():
    records = [{"arrival_s": 0.0, "first_s": 0.1, "last_s": 0.5, "tokens": 5},
               {"arrival_s": 1.5, "first_s": 2.5, "last_s": 2.9, "tokens": 3},
               {"arrival_s": 2.0, "first_s": None, "last_s": None, "tokens": 0}]
    s = summarize(records, (1.0, 2.0))
    assert s["requests"] == 3 and s["completed"] == 2
    assert s["burst_ttft_ms"]["n"] == 1 and abs(s["burst_ttft_ms"]["p99"] - 1000.0) < 1e-6
    assert abs(s["tpot_ms"]["max"] - 200.0) < 1e-6


def test_unknown_modes_are_refused():
    with pytest.raises(WorkloadError, match="unknown burst modes"):
        DeviceBurstConfig(modes=("lifo",))


def test_every_mode_runs_and_cfs_pages_into_lent_memory():
    cfg = DeviceBurstConfig(shape="tiny", device="cpu", dtype="float32", kv_blocks=12, block_size=8,
                            prompt_tokens=(16, 32), output_tokens=12, steady_s=0.5, burst_s=1.5, after_s=0.5,
                            lend_mb=8, transfer_blocks=(4,), transfer_repeats=2,
                            steady_rate_per_s=4.0)   # fixed: a loaded machine measures no capacity
    result = run_device_burst(cfg, log=lambda *_: None)
    assert set(result["modes"]) == {"fcfs", "cfs-host", "cfs-lent"}
    for mode in result["modes"].values():
        assert mode["completed"] == mode["requests"] == result["requests"] > 0
    lent = result["modes"]["cfs-lent"]
    assert lent["pages_out"] > 0 and lent["fell_back_to_host"] == 0   # the burst paged, into lent memory
    assert {t["destination"] for t in result["transfers"]} == {"host", "lent"}
    assert "ttft p99" in format_table(result)
