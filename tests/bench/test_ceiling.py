import json

import pytest
from bench_helpers import mode_result

from backfill.bench.ceiling import offline_ceiling, offline_ceilings
from backfill.bench.coserve_bench import headline
from backfill.bench.report import ModeResult, write_report


def _with_engine(run: ModeResult, busy_s: dict[str, float], tokens: dict[str, int]) -> ModeResult:
    return ModeResult(run.metrics, run.records, {"engine": {"mode_busy_s": busy_s, "mode_offline_tokens": tokens}})


def _three_modes() -> dict[str, ModeResult]:
    alone = _with_engine(mode_result(0.1, 0, []), {"online": 1.0}, {"online": 0})
    priority = mode_result(0.5, 60, [])
    coserve = _with_engine(mode_result(0.1, 40, [2.0]), {"co-serving": 1.2, "offline-batching": 3.0},
                           {"co-serving": 4, "offline-batching": 36})
    return {"online-only": alone, "priority": priority, "coserve": coserve}


def test_ceiling_is_the_time_online_work_leaves_at_the_batching_rate():
    results = _three_modes()
    c = offline_ceiling(results)
    duration_s = results["coserve"].metrics.duration_s
    assert c.batching_tokens_per_s == pytest.approx(12.0)  # 36 tokens in 3 s of batching
    assert c.ceiling_tokens_per_s == pytest.approx((duration_s - 1.0) * 12.0 / duration_s)
    assert c.measured_tokens_per_s == results["coserve"].metrics.offline.tokens_per_s
    priority = results["priority"].metrics.offline.tokens_per_s
    assert c.ceiling_vs_priority == pytest.approx(c.ceiling_tokens_per_s / priority)
    assert c.measured_vs_priority == pytest.approx(c.measured_tokens_per_s / priority)


def test_no_ceiling_without_the_runs_or_counters_it_needs():
    results = _three_modes()
    assert offline_ceiling({k: v for k, v in results.items() if k != "online-only"}) is None
    assert offline_ceiling({k: v for k, v in results.items() if k != "coserve"}) is None
    no_counters = dict(results, **{"online-only": mode_result(0.1, 0, [])})
    assert offline_ceiling(no_counters) is None
    never_batched = dict(results, coserve=_with_engine(mode_result(0.1, 4, []), {"co-serving": 5.0}, {"co-serving": 4}))
    assert offline_ceiling(never_batched) is None
    without_priority = offline_ceiling({k: v for k, v in results.items() if k != "priority"})
    assert without_priority is not None and without_priority.ceiling_vs_priority is None


def test_every_mode_that_ran_offline_batches_gets_its_ceiling():
    results = _three_modes()
    results["coserve:rider_cost_share=1"] = _with_engine(mode_result(0.1, 50, []),
                                                         {"co-serving": 1.5, "offline-batching": 2.0},
                                                         {"co-serving": 20, "offline-batching": 30})
    ceilings = offline_ceilings(results)
    assert list(ceilings) == ["coserve", "coserve:rider_cost_share=1"]  # priority runs no such batches
    assert ceilings["coserve:rider_cost_share=1"].batching_tokens_per_s == pytest.approx(15.0)


def test_report_states_the_ceiling(tmp_path):
    files = write_report(_three_modes(), tmp_path)
    doc = json.loads(files.json.read_text())
    assert doc["offline_ceiling"]["coserve"]["batching_tokens_per_s"] == pytest.approx(12.0)
    text = files.markdown.read_text()
    assert "## Offline ceiling" in text and "| coserve | 1.0 |" in text and "x priority)" in text
    alone_only = write_report({"online-only": _three_modes()["online-only"]}, tmp_path / "one")
    assert json.loads(alone_only.json.read_text())["offline_ceiling"] == {}
    assert "## Offline ceiling" not in alone_only.markdown.read_text()


def test_the_cli_table_names_the_ceiling_against_priority_or_alone():
    results = _three_modes()
    c = offline_ceiling(results)
    line = headline(results).splitlines()[-1]
    assert line.startswith("coserve: offline ceiling") and f"{c.ceiling_vs_priority:.3f}x priority" in line
    without_priority = {k: v for k, v in results.items() if k != "priority"}
    share = c.measured_tokens_per_s / c.ceiling_tokens_per_s
    assert headline(without_priority).splitlines()[-1].endswith(f"reached {share:.0%} of it")
