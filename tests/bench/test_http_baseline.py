import json

from bench_helpers import BPETokenizer, FakeOpenAIServer

from backfill.bench.coserve_bench import run_http_with_baseline
from backfill.bench.scenario import CoserveScenario
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
