import json

import pytest
from bench_helpers import mode_result

from backfill.bench.report import ModeResult, format_summary, ratios, write_report


def test_write_report_files(tmp_path):
    results = {"online-only": mode_result(0.1, 0, []), "coserve": mode_result(0.11, 40, [2.0, 3.0])}
    files = write_report(results, tmp_path / "out")
    doc = json.loads(files.json.read_text())
    assert doc["baseline"] == "online-only" and set(doc["modes"]) == {"online-only", "coserve"}
    co = doc["modes"]["coserve"]
    assert co["config"] == {"policy": "x"}
    assert co["ratios_to_baseline"]["P99 TTFT (ms)"] == pytest.approx(1.1)
    assert co["ratios_to_baseline"]["offline tok/s"] is None  # the baseline has no offline throughput
    assert co["metrics"]["preemptions"] == 2
    md = files.markdown.read_text()
    assert "| mode | P99 TTFT (ms) | P99 TPOT (ms) | online tok/s | offline tok/s | total tok/s" in md
    assert "| coserve | 110.0 (1.10x) |" in md
    assert "| online-only | 100.0 (1.00x) |" in md
    assert [p.name for p in files.plots] == ["throughput.png", "latency.png", "engine.png"]
    for p in files.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    lines = files.requests[1].read_text().splitlines()
    assert len(lines) == 11 and json.loads(lines[0])["ttft_ms"] == pytest.approx(110)
    # Every coserve TTFT is 1.1x its twin's, so each resample gives 1.1 too; TPOTs are equal.
    ttft = co["ratio_intervals_95"]["P99 TTFT"]
    assert [ttft["ratio"], ttft["low"], ttft["high"]] == pytest.approx([1.1] * 3) and ttft["pairs"] == 10
    assert co["ratio_intervals_95"]["P99 TPOT"]["ratio"] == pytest.approx(1.0)
    assert "ratio_intervals_95" not in doc["modes"]["online-only"]
    assert "| coserve | 1.10x [1.10, 1.10] | 1.00x [1.00, 1.00] |" in md


def test_report_without_baseline(tmp_path):
    files = write_report({"coserve": mode_result(0.1, 10, [])}, tmp_path)
    assert json.loads(files.json.read_text())["baseline"] is None
    assert "ratios omitted" in files.markdown.read_text()
    assert len(files.plots) == 3


def test_report_breaks_engine_time_down_by_step_mode(tmp_path):
    run = mode_result(0.1, 10, [])
    engine = {"mode_busy_s": {"co-serving": 2.0, "offline-batching": 4.0},
              "mode_offline_tokens": {"co-serving": 10, "offline-batching": 800}}
    md = write_report({"coserve": ModeResult(run.metrics, run.records, {"engine": engine})}, tmp_path).markdown
    text = md.read_text()
    assert "## Engine time by step mode" in text
    assert "| coserve | offline-batching | 4.0 | 800 | 200.0 |" in text
    assert "| coserve | co-serving | 2.0 | 10 | 5.0 |" in text


def test_ratios_and_summary_text():
    base, co = mode_result(0.1, 0, []), mode_result(0.2, 20, [5.0])
    r = ratios(co.metrics, base.metrics)
    assert r["P99 TTFT (ms)"] == pytest.approx(2.0) and r["online tok/s"] == pytest.approx(
        co.metrics.online.tokens_per_s / base.metrics.online.tokens_per_s)
    text = format_summary("coserve", co.metrics)
    assert "coserve" in text and "P99 TTFT (ms)" in text and "200.0" in text
    assert "Goodput req/s (TTFT<=200ms, TPOT<=100ms)" in text


def test_plots_keep_every_modes_values_on_their_axes(tmp_path, monkeypatch):
    import backfill.bench.report as report

    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    # Online-only first, with far less throughput and latency than the modes after it: a limit set
    # while drawing the first row froze the shared axes at its range.
    results = {"online-only": mode_result(0.1, 0, []), "priority": mode_result(2.0, 400, [])}
    report.plot_throughput(results, tmp_path / "t.png")
    report.plot_latency(results, tmp_path / "l.png")
    throughput, latency = figures
    top = max(max(v) for res in results.values() for v in res.metrics.timeseries.tokens_per_s.values())
    assert all(ax.get_ylim()[1] >= top for ax in throughput.axes)
    ttft_axes = latency.axes[0::2]
    assert all(ax.get_yscale() == "log" and ax.get_ylim()[1] >= 2000.0 for ax in ttft_axes)
