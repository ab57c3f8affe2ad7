"""Rows of the node / burst device check from what its parts wrote, cut-short runs included."""

import json

from backfill.bench.node_burst_summary import summarize_dir


def phase(ttft, tpot, offline=True):
    p = {"online": {"ttft_ms": {"p99": ttft}, "tpot_ms": {"p99": tpot}},
         "preemptions_per_online_request": {"mean": 0.5, "max": 1}}
    if offline:
        p.update({"offline": {"tokens_per_s": 900.0, "lost_tokens": 40},
                  "memory": {"reclaim_ms": {"n": 3, "p50": 1.0, "p99": 2.5}},
                  "pause": {"cooperative_ack_ms": {"p99": 0.4}}})
    return p


def test_rows_from_both_benchmarks_and_the_parts_that_did_not_run(tmp_path):
    (tmp_path / "node.json").write_text(json.dumps({"phases": {
        "alone": phase(100.0, 10.0, offline=False), "valve": phase(105.0, 10.2), "fifo": phase(120.0, 11.0)},
        "summary": {"selective_vs_fifo_lost_tokens": {"selective": 40, "fifo": 80, "reduction": 0.5}}}))
    (tmp_path / "burst.json").write_text(json.dumps({
        "requests": 30, "steady_rate_per_s": 2.0, "link": {"pcie_gb_per_s": 63.0, "pcie_gen": 5, "pcie_width": 16,
                                                           "source": "pynvml"},
        "modes": {"fcfs": {"ttft_ms": {"p99": 900.0}, "burst_ttft_ms": {"p99": 950.0}, "completed": 30,
                           "requests": 30},
                  "cfs-host": {"ttft_ms": {"p99": 90.0}, "burst_ttft_ms": {"p99": 95.0}, "completed": 30,
                               "requests": 30, "pages_out": 12}},
        "p99_ttft_fcfs_over_cfs_host": 10.0,
        "transfers": [{"destination": "host", "direction": "out", "blocks": 256, "bytes": 94 * 2**20,
                       "gb_per_s": 31.5}]}))
    (tmp_path / "parts.json").write_text(json.dumps({"node": {"outcome": "ok"},
                                                     "cuda-tests": {"outcome": "timeout", "detail": "cut at 25 s"}}))
    result = summarize_dir(tmp_path)
    values = {r["measure"]: r["value"] for r in result["rows"]}
    assert values["online P99 TTFT, valve"] == "105.0 ms (1.05x alone)"
    assert values["preemptions per online request, fifo"] == "mean 0.50, max 1"
    assert values["reclamation latency, valve"].startswith("p50 1.00 ms, p99 2.50 ms")
    assert values["lost tokens, selective vs FIFO reclamation"] == "40 vs 80 (50% fewer)"
    assert values["burst P99 TTFT, FCFS / CFS-host"] == "10.00x"
    assert values["KV page out to host, 94 MB gathered"] == "31.5 GB/s (50% of peak)"
    assert result["skipped"] == ["cuda-tests: timeout (cut at 25 s)"]
    assert json.loads((tmp_path / "summary.json").read_text())["part"] == "node-burst"
    assert "| online P99 TTFT, fifo |" in (tmp_path / "summary.md").read_text()


def test_missing_and_unreadable_files_become_skipped_lines(tmp_path):
    (tmp_path / "burst.json").write_text("{not json")
    result = summarize_dir(tmp_path)
    assert result["rows"] == []
    assert result["skipped"][0] == "node.json missing" and result["skipped"][1].startswith("burst.json unreadable")


def test_the_device_check_script_lists_its_parts_and_imports_without_the_servers_dependencies(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(["bash", str(root / "scripts" / "gpu_check_node_burst.sh"), "--dry-run", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    for part in ("imports", "cuda-tests", "node", "burst"):
        assert f"- {part} (cap " in run.stdout
    assert "absent-on-device modules imported: none" in run.stdout
    assert not any(tmp_path.iterdir())          # a dry run writes nothing
