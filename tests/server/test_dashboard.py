"""The live page: /dashboard/data's numbers are /metrics' (as Prometheus computes them), and the
page itself, rendered in headless Chromium against a real server under online and offline load,
shows them."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backfill.server.dashboard import quantile
from server_helpers import ServerProcess, assert_error, chat_line, live_server, openai_client, upload, wait_final

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def prometheus_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile() as Prometheus documents it, written out independently of the product's."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total == 0:
        return None
    rank = q * total
    for i, (upper, count) in enumerate(buckets):
        if count >= rank:
            lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
            if math.isinf(upper):
                return lower
            return upper if count == below else lower + (upper - lower) * (rank - below) / (count - below)
    return None


def from_metrics(text: str) -> dict[str, float | None]:
    """The numbers the page shows, from a /metrics scrape of a server younger than the page's window."""
    buckets: dict[str, list[tuple[float, float]]] = {"ttft": [], "tpot": []}
    values: dict[str, float] = {}
    online_requests = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            online = sample.labels.get("class") == "online"
            if sample.name == "backfill_time_to_first_token_seconds_bucket" and online:
                buckets["ttft"].append((float(sample.labels["le"]), sample.value))
            elif sample.name == "backfill_time_per_output_token_seconds_bucket" and online:
                buckets["tpot"].append((float(sample.labels["le"]), sample.value))
            elif sample.name == "backfill_requests_total" and online:
                online_requests += sample.value
            elif sample.name == "backfill_output_tokens_total":
                values[sample.labels["class"] + "_tokens"] = sample.value
            elif sample.name in ("backfill_prefix_cache_queries_total", "backfill_prefix_cache_hits_total"):
                kind = "queries" if "queries" in sample.name else "hits"
                values[f"prefix_{kind}_{sample.labels['class']}"] = sample.value
            elif set(sample.labels) <= {"model_name"}:
                values[sample.name] = sample.value
            elif sample.name == "backfill_queue_length":
                values["queue_" + sample.labels["class"]] = sample.value

    def ms(q: float, kind: str) -> float | None:
        value = prometheus_quantile(q, buckets[kind])
        return None if value is None else value * 1e3

    def hit_pct(*classes: str) -> float | None:
        queries = sum(values[f"prefix_queries_{c}"] for c in classes)
        return None if queries == 0 else 100 * sum(values[f"prefix_hits_{c}"] for c in classes) / queries

    return {"ttft_p50_ms": ms(0.5, "ttft"), "ttft_p99_ms": ms(0.99, "ttft"), "tpot_p50_ms": ms(0.5, "tpot"),
            "tpot_p99_ms": ms(0.99, "tpot"), "online_requests": online_requests,
            "online_tokens": values["online_tokens"], "offline_tokens": values["offline_tokens"],
            "preemptions": values["backfill_preemptions_total"],
            "online_busy_s": values["backfill_online_busy_seconds_total"],
            "queue_online": values["queue_online"], "queue_offline": values["queue_offline"],
            "kv_usage_pct": values["backfill_kv_cache_usage_ratio"] * 100,
            "batch_lines_waiting": values["backfill_batch_lines_waiting"],
            "prefix_cache_queries": values["prefix_queries_online"] + values["prefix_queries_offline"],
            "prefix_cache_hit_pct": hit_pct("online", "offline"),
            "prefix_cache_hit_online_pct": hit_pct("online"), "prefix_cache_hit_offline_pct": hit_pct("offline")}


def test_quantile_follows_histogram_quantile():
    inf = math.inf
    buckets = ((0.1, 2.0), (0.2, 6.0), (0.5, 10.0), (inf, 10.0))
    assert quantile(0.5, buckets) == pytest.approx(0.175)       # 0.1 + 0.1 * (5 - 2) / (6 - 2)
    assert quantile(0.99, buckets) == pytest.approx(0.4925)
    assert quantile(0.99, ((0.1, 1.0), (inf, 5.0))) == 0.1        # past the last bound: the bound
    assert quantile(0.5, ((0.1, 0.0), (inf, 0.0))) is None         # no observations: no number
    for q in (0.5, 0.9, 0.99):
        assert quantile(q, buckets) == pytest.approx(prometheus_quantile(q, list(buckets)))


def online_and_flex_load(url: str, seconds: float, online_tokens: int = 8, flex_tokens: int = 24) -> None:
    """Online requests back to back beside flex (offline-class) ones, from two threads each."""
    stop = time.monotonic() + seconds

    def client(body: dict) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < stop:
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text

    bodies = [{"prompt": "hello there", "max_tokens": online_tokens, "ignore_eos": True}] * 2 + \
             [{"prompt": "summarise this", "max_tokens": flex_tokens, "ignore_eos": True, "service_tier": "flex"}] * 2
    threads = [threading.Thread(target=client, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_dashboard_data_is_what_metrics_says(tmp_path):
    with live_server(tmp_path) as server:
        online_and_flex_load(server.url, 2.0)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            data = http.get("/dashboard/data").json()
            expected = from_metrics(http.get("/metrics").text)
            model = data["models"][0]
            window = model["window"]
            for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                assert window[key] == pytest.approx(expected[key], rel=1e-9), key
            for key in ("online_requests", "online_tokens", "offline_tokens", "preemptions"):
                assert window[key] == expected[key], key
            assert window["online_requests"] > 0 and window["offline_tokens"] > 0
            prefix = window["prefix_cache"]
            assert prefix["queries"] == expected["prefix_cache_queries"] > 0
            assert 100 * prefix["hit_rate"] == pytest.approx(expected["prefix_cache_hit_pct"])
            for cls in ("online", "offline"):
                shown = prefix["hit_rate_by_class"][cls]
                assert (None if shown is None else 100 * shown) == pytest.approx(
                    expected[f"prefix_cache_hit_{cls}_pct"]), cls
            assert window["offline_tokens_per_s"] == pytest.approx(window["offline_tokens"] / window["duration_s"])
            assert window["idle_share"] == pytest.approx(1 - expected["online_busy_s"] / window["duration_s"],
                                                         abs=0.02)
            assert model["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}
            assert model["series"] and all(p["t_s"] <= 0 for p in model["series"])
            page = http.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "dashboard/data" in page.text
            assert_error(http.get("/dashboard/data", params={"window_s": "soon"}), 400, param="window_s")
            assert_error(http.get("/dashboard/data", params={"window_s": "1"}), 400, param="window_s")


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", "--virtual-time-budget=8000", *args],
                          capture_output=True, text=True, timeout=120)


def page_numbers(dom: str, model: str = "0") -> dict[str, float | None]:
    shown = re.findall(r'<span data-model="([^"]+)" data-metric="([^"]+)">([^<]*)</span>', dom)
    return {name: (None if text == "–" else float(text)) for owner, name, text in shown if owner == model}


def render(url: str, screenshot: Path | None = None) -> str:
    done = chromium("--dump-dom", url)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'data-loaded="true"' in done.stdout, done.stdout[-2000:]
    if screenshot is not None:
        shot = chromium("--window-size=1400,900", f"--screenshot={screenshot}", url)   # where the batch table overflowed
        assert shot.returncode == 0, shot.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)")
def test_page_in_headless_chromium_shows_what_metrics_says(tmp_path):
    server = ServerProcess(tmp_path / "s.db").wait_ready()
    try:
        client = openai_client(server.url)
        system = {"role": "system", "content": "You answer questions about the sea, its tides, its fish and its "
                                               "ships, in one short sentence, politely and without lists."}
        lines = [chat_line(f"line-{i}", max_tokens=24, ignore_eos=True,
                           messages=[system, {"role": "user", "content": f"request {i}"}]) for i in range(24)]
        batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        loader = threading.Thread(target=online_and_flex_load, args=(server.url, 6.0))
        loader.start()
        # Under load: the page renders, with work on the device.
        during = page_numbers(render(f"{server.url}/dashboard"))
        loader.join()
        assert wait_final(client, batch.id, timeout_s=120).status == "completed"
        assert during["online_requests"] is not None
        # Quiet: every number the page shows is the one /metrics gives.
        dom = render(f"{server.url}/dashboard", screenshot=tmp_path / "dashboard.png")
        shown = page_numbers(dom)
        expected = from_metrics(httpx.get(f"{server.url}/metrics").text)
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert shown[key] == pytest.approx(expected[key], abs=0.051), key   # shown to 0.1 ms
        for key in ("online_requests", "online_tokens", "offline_tokens", "preemptions", "queue_online",
                    "queue_offline", "batch_lines_waiting"):
            assert shown[key] == expected[key], key
        assert shown["kv_usage_pct"] == pytest.approx(expected["kv_usage_pct"], abs=0.051)
        assert shown["prefix_cache_queries"] == expected["prefix_cache_queries"] > 0
        for key in ("prefix_cache_hit_pct", "prefix_cache_hit_online_pct", "prefix_cache_hit_offline_pct"):
            digits = 0.051 if key == "prefix_cache_hit_pct" else 0.51   # shown to 0.1 and to 1
            assert (shown[key] is None) == (expected[key] is None), key
            if shown[key] is not None:
                assert shown[key] == pytest.approx(expected[key], abs=digits), key
        # the 24 lines share a system prompt's full blocks: the offline hit rate is above zero
        assert expected["prefix_cache_hit_offline_pct"] > 0
        assert shown["online_requests"] > 0 and shown["offline_tokens"] >= 24 * 24
        # Both shown to 0.1: the rate within its rounding and the window's.
        assert shown["offline_tokens_per_s"] == pytest.approx(shown["offline_tokens"] / shown["window_s"],
                                                              rel=0.01, abs=0.06)
        assert shown["idle_share_pct"] == pytest.approx(100 * (1 - expected["online_busy_s"] / shown["window_s"]),
                                                        abs=1.0)
        assert f'data-batch="{batch.id}"' in dom and "24/24" in dom
        png = (tmp_path / "dashboard.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    finally:
        server.stop()


def saturating_online_load(url: str, seconds: float, clients: int = 4) -> dict[int, int]:
    """Online requests back to back from more clients than the server admits: responses by status."""
    stop = time.monotonic() + seconds
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < stop:
                status = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 24,
                                                            "ignore_eos": True}).status_code
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


@pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)")
def test_page_shows_refusals_and_why_offline_work_waits(tmp_path):
    # online-only serves online requests alone: the batch below waits while online load lasts.
    server = ServerProcess(tmp_path / "s.db", None, "--policy", "online-only", "--max-online-queue", "2").wait_ready()
    try:
        client = openai_client(server.url)
        lines = [chat_line(f"line-{i}", f"request {i}", max_tokens=16, ignore_eos=True) for i in range(30)]
        client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        statuses = saturating_online_load(server.url, 12.0)
        assert statuses.get(429, 0) > 0 and statuses.get(200, 0) > 0, statuses
        time.sleep(1.5)   # a sample of the sampler after the last request
        dom = render(f"{server.url}/dashboard?window_s=60", screenshot=tmp_path / "dashboard-refusals.png")
        shown = page_numbers(dom)
        text = httpx.get(f"{server.url}/metrics").text
        rejected = {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
                    for sample in family.samples if sample.name == "backfill_requests_rejected_total"
                    and sample.labels["class"] == "online"}
        stalled = {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "backfill_offline_stalled_seconds_total"}
        # Refusals: the page's counts are the clients' 429s, by reason, beside those served.
        assert shown["refused_total"] == statuses[429] == sum(rejected.values())
        assert shown["refused_queue_full"] == rejected["queue_full"] == statuses[429]
        assert shown["refused_slo_overload"] == 0
        assert shown["served_online"] == statuses[200]
        # Offline work: none advanced (the policy serves online alone), and the page says why.
        assert shown["offline_tokens"] == 0
        assert stalled["online_saturates"] >= 6.0, stalled
        assert shown["stalled_online_saturates_pct"] >= 100 * 6.0 / shown["window_s"] - 1, shown
        assert 'data-stall-reason="online_saturates"' in dom and "online saturates the machine" in dom
        assert (tmp_path / "dashboard-refusals.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        server.stop()


def nearest_rank(q: float, values: list[float]) -> float:
    """The exact quantile of values: the smallest one with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def test_page_p99_is_within_ten_percent_of_the_access_logs_at_two_loads(tmp_path):
    """The page's P99 TTFT (from histogram buckets) against the exact P99 of the same requests'
    ttft_ms in the JSON access log, with one client and with four."""
    import json

    # Admission by predicted TTFT off: every request is served, so the page and the log see the same ones.
    server = ServerProcess(tmp_path / "s.db", None, "--log-level", "info", "--log-format", "json",
                           "--admission-ttft-share", "inf").wait_ready()
    try:
        figures = {}
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, timeout=120)
        for phase, clients in (("light", 1), ("heavy", 4)):
            time.sleep(5.0)   # the page's shortest window (5 s) starts after the last phase's (or warm-up's) sample
            started = time.monotonic()

            def client(k: int) -> None:
                with httpx.Client(base_url=server.url, timeout=60) as http:
                    for n in range(60 // clients):
                        response = http.post("/v1/completions", headers={"x-request-id": f"{phase}-{k}-{n}"},
                                             json={"prompt": "hello there " * (1 + n % 5), "max_tokens": 8})
                        assert response.status_code == 200, response.text

            threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(1.5)   # one sample of the sampler after the phase's last request
            # The page's shortest window is 5 s; a fast machine finishes a phase in less.
            window_s = max(math.ceil(time.monotonic() - started + 1), 5)
            response = httpx.get(f"{server.url}/dashboard/data", params={"window_s": window_s})
            assert response.status_code == 200, response.text
            page = response.json()
            shown_ms = page["models"][0]["window"]["ttft_p99_ms"]
            lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
            ttfts = [line["ttft_ms"] for line in lines if line.get("logger") == "backfill.access"
                     and line["request_id"].startswith(phase + "-") and line["status"] == 200]
            assert page["models"][0]["window"]["online_requests"] == len(ttfts) == 60
            exact_ms = nearest_rank(0.99, ttfts)
            figures[phase] = (len(ttfts), shown_ms, exact_ms)
            assert shown_ms == pytest.approx(exact_ms, rel=0.10), figures
        print("P99 TTFT (requests, page ms, access log ms):", figures)
    finally:
        server.stop()


def test_why_offline_work_does_not_advance(tmp_path):
    from dataclasses import replace

    from backfill.server.dashboard import DashboardSampler, Reading

    with live_server(tmp_path) as server:
        sampler = DashboardSampler(server.state)
        before = Reading(0.0, (), (), 0.0, offline_tokens=10, online_tokens=0, online_busy_s=0.0, preemptions=0)
        after = replace(before, t_s=1.0)
        assert sampler.stall_reason(before, replace(after, offline_tokens=11), 5) is None   # it advanced
        assert sampler.stall_reason(before, after, 0) == "no_offline_work"
        assert sampler.stall_reason(before, replace(after, online_busy_s=0.95), 5) == "online_saturates"
        # Online held the device from one reading to the next, its steps over half the second.
        held = sampler.stall_reason(replace(before, online_seqs=1), replace(after, online_busy_s=0.6, online_seqs=2), 5)
        assert held == "online_saturates"
        assert sampler.stall_reason(before, replace(after, online_busy_s=0.6), 5) == "other"
        server.state.offline_paused = lambda: True
        assert sampler.stall_reason(before, replace(after, online_busy_s=0.95), 5) == "paused_by_node_gate"
        assert sampler.stall_reason(before, after, 0) == "no_offline_work"   # nothing to hold back
