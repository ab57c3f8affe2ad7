import json
from dataclasses import asdict

import pytest
from bench_helpers import BPETokenizer, FakeOpenAIServer

from backfill.bench.coserve_bench import run_http_with_baseline
from backfill.bench.scenario import CoserveScenario
from backfill.errors import WorkloadError
from backfill.policy.latency_model import LatencyModel

# 40 ms prefill, 40 ms decode steps: one 16-token request keeps the engine busy ~0.7 s.
LATENCY = LatencyModel((1, 4096), (40.0, 80.0))


def test_baseline_runs_the_same_trace_without_the_backlog(tmp_path):
    scenario = CoserveScenario(duration_s=2.0, online_load=0.5, prompt_len="fixed:8", output_len="fixed:4",
                               offline_prompt_len="fixed:8", offline_output_len="fixed:4", offline_concurrency=2,
                               warmup_s=0.0)
    with FakeOpenAIServer(pace_s=0.002) as server:
        results = run_http_with_baseline(server.base_url, "m", scenario, BPETokenizer(), LATENCY, label="peer",
                                         out_dir=tmp_path, offline_mark="priority", progress=False)
        bodies = list(server.bodies)
    assert list(results) == ["peer online-only", "peer"]
    alone, both = results["peer online-only"].metrics, results["peer"].metrics
    assert alone.online.requests == both.online.requests > 0
    assert alone.offline.requests == 0 and both.offline.output_tokens > 0
    marked = [b for b in bodies if "priority" in b]
    assert marked and all(b["priority"] == 1 and "service_tier" not in b for b in marked)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["baseline"] == "peer online-only" and report["modes"]["peer"]["ratios_to_baseline"]


def _scenario(**changes) -> CoserveScenario:
    return CoserveScenario(**{**dict(duration_s=2.0, online_load=0.5, prompt_len="fixed:8", output_len="fixed:4",
                                     offline_prompt_len="fixed:8", offline_output_len="fixed:4",
                                     offline_concurrency=2, warmup_s=0.0), **changes})


def test_the_two_phases_apart_give_what_one_invocation_gives(tmp_path):
    from backfill.bench.coserve_bench import run_http_coserved, run_http_online_only

    baseline = tmp_path / "baseline.json"
    with FakeOpenAIServer(pace_s=0.002) as server:
        first = run_http_online_only(server.base_url, "m", _scenario(), BPETokenizer(), LATENCY, label="peer",
                                     baseline_file=baseline, out_dir=tmp_path / "one", progress=False)
        sent_alone = len(server.bodies)
        # Between the phases a strict server is restarted with the file's P99s as its SLOs.
        doc = json.loads(baseline.read_text())
        alone = first["peer online-only"].metrics.online
        assert doc["p99_ttft_ms"] == alone.ttft_ms.p99 > 0 and doc["p99_tpot_ms"] == alone.tpot_ms.p99 > 0
        results = run_http_coserved(server.base_url, "m", _scenario(), BPETokenizer(), LATENCY, label="peer",
                                    baseline_file=baseline, out_dir=tmp_path / "two", progress=False)
        offline_bodies = [b for b in server.bodies[sent_alone:] if b.get("service_tier") == "flex"]
    assert sent_alone == alone.requests and offline_bodies
    assert list(results) == ["peer online-only", "peer"]
    # The baseline read back is the run that was written: same requests, same P99s.
    read = results["peer online-only"].metrics.online
    assert read.requests == alone.requests and read.ttft_ms.p99 == alone.ttft_ms.p99
    both = results["peer"].metrics
    assert both.online.requests == alone.requests and both.offline.output_tokens > 0
    assert both.slo.ttft_ms == doc["p99_ttft_ms"] and both.slo.tpot_ms == doc["p99_tpot_ms"]
    report = json.loads((tmp_path / "two" / "report.json").read_text())
    ratio = report["modes"]["peer"]["ratios_to_baseline"]["P99 TTFT (ms)"]
    assert report["baseline"] == "peer online-only" and ratio == both.online.ttft_ms.p99 / doc["p99_ttft_ms"]


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    ("{not json", "not readable JSON"),
    ('{"format": "something else"}', "not an online-only baseline file"),
    ('{"format": "backfill-http-online-baseline/1", "label": "x", "duration_s": 1}', "malformed: KeyError"),
    ('{"format": "backfill-http-online-baseline/1", "label": "x", "duration_s": 1, "p99_ttft_ms": 1, '
     '"p99_tpot_ms": 1, "records": [{"request_id": "a", "request_class": "sideways"}]}', "malformed: ValueError"),
    ('{"format": "backfill-http-online-baseline/1", "label": "x", "duration_s": 1, "p99_ttft_ms": null, '
     '"p99_tpot_ms": null, "records": []}', "no completed online request"),
])
def test_a_missing_or_malformed_baseline_file_is_a_workload_error(tmp_path, content, match):
    from backfill.bench.http_baseline import read_baseline

    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(WorkloadError, match=match):
        read_baseline(path)


def test_a_baseline_of_another_scenario_is_refused(tmp_path):
    from backfill.bench.coserve_bench import run_http_online_only
    from backfill.bench.http_baseline import read_baseline

    baseline = tmp_path / "baseline.json"
    with FakeOpenAIServer(pace_s=0.002) as server:
        run_http_online_only(server.base_url, "m", _scenario(), BPETokenizer(), LATENCY, baseline_file=baseline,
                             out_dir=tmp_path, progress=False)
    read_baseline(baseline, asdict(_scenario()))
    with pytest.raises(WorkloadError, match="differs in online_load"):
        read_baseline(baseline, asdict(_scenario(online_load=0.3)))


@pytest.mark.parametrize("extra, message", [
    ([], "--phase coserved needs --baseline-file"),
    (["--baseline-file", "no-such-file.json"], "does not exist"),
])
def test_the_cli_refuses_a_coserved_phase_without_its_baseline(tmp_path, capsys, extra, message):
    from backfill.cli import main

    code = main(["bench", "coserve", "--url", "http://127.0.0.1:1", "--phase", "coserved",
                 "--out", str(tmp_path), *extra])
    assert code == 2 and message in capsys.readouterr().err
