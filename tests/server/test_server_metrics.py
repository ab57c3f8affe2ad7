"""/metrics: backfill's series and vLLM's under vLLM's names, per model, fine latency buckets,
HTTP status counters, the process' own metrics, no `*_created` noise."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backfill.server.metrics import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S, geometric_buckets, token_buckets
from server_helpers import live_server, openai_client, sample_value

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"


def dashboard_series(name: str, pattern: str) -> set[str]:
    """The series a dashboard's panel queries read (their names as /metrics has them)."""
    dashboard = json.loads((DASHBOARDS / name).read_text())
    return {series for panel in dashboard["panels"] for target in panel.get("targets", [])
            for series in re.findall(pattern, target["expr"])}


def test_latency_buckets_are_within_ten_percent_of_each_other():
    for bounds in (LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S, geometric_buckets(0.5, 2.0, per_decade=40)):
        assert list(bounds) == sorted(set(bounds))
        assert max(b / a for a, b in zip(bounds, bounds[1:])) <= 1.1 + 1e-9
    assert LATENCY_BUCKETS_S[0] == 0.001 and LATENCY_BUCKETS_S[-1] >= 600
    assert token_buckets(512) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """One server after a completion and a refused request (an unknown route: 404)."""
    with live_server(tmp_path_factory.mktemp("metrics"), served_model_name="tiny-test") as server:
        client = openai_client(server.url)
        before = httpx.get(f"{server.url}/metrics").text
        out = client.completions.create(model="tiny-test", prompt="one two three", max_tokens=5, extra_body={
            "ignore_eos": True})
        httpx.get(f"{server.url}/no/such/route")
        httpx.request("TRACE", f"{server.url}/coffee")   # a method not counted by name: "other"
        httpx.get(f"{server.url}/health")
        yield before, httpx.get(f"{server.url}/metrics").text, out


def test_every_per_model_series_has_model_name(scraped):
    _, text, _ = scraped
    server_wide = ("process_", "python_", "backfill_http_", "backfill_store_damaged_reads")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(server_wide):
                assert sample.labels.get("model_name") == "tiny-test", sample
    assert "_created" not in text
    assert sample_value(text, "process_resident_memory_bytes") > 0
    assert sample_value(text, "backfill_build_info", model_name="tiny-test") == 1


def test_vllm_series_under_vllm_names(scraped):
    before, text, out = scraped
    names = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    read = dashboard_series("vllm.json", r"vllm:\w+")
    assert len(read) >= 15 and not read - names, read - names   # every series vLLM's dashboard reads
    assert all(name in before for name in read)   # exported from the start, zero until used
    ours = dashboard_series("backfill.json", r"\b(?:backfill|process)_\w+")
    assert not ours - names, ours - names
    engine = {"model_name": "tiny-test", "engine": "0"}
    assert sample_value(text, "vllm:prompt_tokens_total", **engine) == out.usage.prompt_tokens
    assert sample_value(text, "vllm:generation_tokens_total", **engine) >= out.usage.completion_tokens
    assert sample_value(text, "vllm:request_success_total", finished_reason="length", **engine) == 1
    assert sample_value(text, "vllm:time_to_first_token_seconds_count", **engine) == 1
    assert sample_value(text, "vllm:inter_token_latency_seconds_count", **engine) >= 1
    assert sample_value(text, "vllm:request_generation_tokens_sum", **engine) == out.usage.completion_tokens
    assert sample_value(text, "vllm:request_max_num_generation_tokens_sum", **engine) == 5
    assert sample_value(text, "vllm:request_prefill_time_seconds_count", **engine) == 1
    assert sample_value(text, "vllm:request_decode_time_seconds_count", **engine) == 1
    assert 0 <= sample_value(text, "vllm:kv_cache_usage_perc", **engine) <= 1
    # the same request in backfill's own series, by class
    assert sample_value(text, "backfill_request_generation_tokens_count", **{"class": "online"}) == 1
    ttft = sample_value(text, "vllm:time_to_first_token_seconds_sum", **engine)
    assert math.isclose(ttft, sample_value(text, "backfill_time_to_first_token_seconds_sum", **{"class": "online"}))


def test_http_status_counters_by_route(scraped):
    _, text, _ = scraped
    assert sample_value(text, "backfill_http_requests_total", method="POST", handler="/v1/completions",
                        status="200") == 1
    assert sample_value(text, "backfill_http_requests_total", method="GET", handler="unmatched", status="404") == 1
    assert sample_value(text, "backfill_http_requests_total", method="GET", handler="/health", status="200") == 1
    brewed = [line for line in text.splitlines() if line.startswith("backfill_http_requests_total")
              and 'method="other"' in line]
    assert len(brewed) == 1 and "TRACE" not in text, brewed
    assert sample_value(text, "backfill_http_request_duration_seconds_count", method="POST",
                        handler="/v1/completions") == 1


def test_prompt_tokens_count_when_prefilled_not_at_finish(tmp_path):
    with live_server(tmp_path, served_model_name="tiny-test") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": "a b c d", "max_tokens": 400,
                                                             "ignore_eos": True, "stream": True}) as stream:
                lines = stream.iter_lines()
                while '"text"' not in next(lines):
                    pass   # the first token arrived: the prompt is prefilled, the request still runs
                text = http.get("/metrics").text
                assert sample_value(text, "backfill_prompt_tokens_total", **{"class": "online"}) > 0
                assert sample_value(text, "vllm:request_success_total", model_name="tiny-test",
                                    finished_reason="length") == 0
