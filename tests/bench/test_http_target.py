import asyncio

import pytest
from bench_helpers import FakeOpenAIServer, free_port

from backfill.bench.http_target import HttpTarget, parse_gauges, served_model
from backfill.bench.workload import BenchRequest
from backfill.errors import TargetError, WorkloadError


def _req(text: str = "one two three", max_tokens: int = 4) -> BenchRequest:
    return BenchRequest("r0", 0.0, "online", (5, 6, 7), text, max_tokens)


async def _collect(target: HttpTarget, req: BenchRequest) -> list:
    try:
        return [c async for c in target.generate(req)]
    finally:
        await target.aclose()


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(pace_s=0.005) as s:
        yield s


def test_streams_one_chunk_per_token_with_usage(server):
    target = HttpTarget(server.base_url + "/v1/", "m", api_key="secret")
    chunks = asyncio.run(_collect(target, _req(max_tokens=4)))
    assert [c.num_tokens for c in chunks] == [1, 1, 1, 1]
    assert chunks[-1].prompt_tokens == 3 and all(c.prompt_tokens is None for c in chunks[:-1])
    assert all(b.time_s >= a.time_s for a, b in zip(chunks, chunks[1:]))
    body = server.bodies[-1]
    assert body["prompt"] == "one two three" and body["stream"] is True and body["max_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["model"] == "m" and body["temperature"] == 0.0


@pytest.mark.parametrize("mark, tier, priority", [("flex", "flex", None), ("priority", None, 1),
                                                   ("both", "flex", 1)])
def test_offline_requests_carry_the_chosen_marks(mark, tier, priority):
    target = HttpTarget("http://127.0.0.1:1", "m", offline_mark=mark)
    offline = target.payload(BenchRequest("r1", None, "offline", (5, 6), "a b", 3))
    assert offline.get("service_tier") == tier and offline.get("priority") == priority
    online = target.payload(_req())
    assert "service_tier" not in online and "priority" not in online


def test_token_ids_prompt(server):
    target = HttpTarget(server.base_url, "m", prompt_as="token_ids")
    chunks = asyncio.run(_collect(target, _req(max_tokens=2)))
    assert server.bodies[-1]["prompt"] == [5, 6, 7]
    assert sum(c.num_tokens for c in chunks) == 2


def test_usage_credits_tokens_that_share_a_chunk():
    with FakeOpenAIServer(pace_s=0.001, chunk_tokens=3) as s:
        chunks = asyncio.run(_collect(HttpTarget(s.base_url, "m"), _req(max_tokens=7)))
    # Chunks carry 3, 3, 1 tokens but count one each; usage says 7, so the last chunk gets the rest.
    assert [c.num_tokens for c in chunks] == [1, 1, 5]


def test_http_error_raises_target_error(server):
    with pytest.raises(TargetError, match="HTTP 400"):
        asyncio.run(_collect(HttpTarget(server.base_url, "m"), _req("FAIL please")))


def test_connection_refused_is_a_target_error():
    with pytest.raises(TargetError, match="Connect"):
        asyncio.run(_collect(HttpTarget(f"http://127.0.0.1:{free_port()}", "m"), _req()))


def test_sample_stats_reads_gauges_only(server):
    async def go():
        target = HttpTarget(server.base_url, "m")
        try:
            return await target.sample_stats()
        finally:
            await target.aclose()
    assert asyncio.run(go()) == {"fake:num_requests_running": 0.0}
    assert parse_gauges("not prometheus {{{") == {}


def test_bad_arguments():
    with pytest.raises(WorkloadError):
        HttpTarget("localhost:8000", "m")
    with pytest.raises(WorkloadError):
        HttpTarget("http://x", "m", prompt_as="bytes")
    with pytest.raises(WorkloadError):
        HttpTarget("http://x", "m", max_connections=0)
    with pytest.raises(WorkloadError, match="offline_mark"):
        HttpTarget("http://x", "m", offline_mark="low")


@pytest.fixture(scope="module")
def backfill_server(tmp_path_factory):
    """`python -m backfill.server --tiny` on 127.0.0.1: the real server, its HTTP stack and /metrics."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    db = tmp_path_factory.mktemp("serve") / "s.db"
    proc = subprocess.Popen([sys.executable, "-m", "backfill.server", "--tiny", "--port", str(port), "--db", str(db),
                             "--log-level", "warning"], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def test_against_backfill_serve_counts_every_token_and_reads_its_gauges(backfill_server):
    async def go():
        async with HttpTarget(backfill_server, "tiny-random", prompt_as="token_ids") as target:
            online = [c async for c in target.generate(BenchRequest("r0", 0.0, "online", (5, 6, 7), "", 6))]
            offline = [c async for c in target.generate(BenchRequest("r1", None, "offline", (8, 9), "", 4))]
            return online, offline, await target.sample_stats()
    online, offline, stats = asyncio.run(go())
    assert sum(c.num_tokens for c in online) == 6 and online[-1].prompt_tokens == 3
    assert sum(c.num_tokens for c in offline) == 4 and offline[-1].prompt_tokens == 2
    assert stats and all(isinstance(v, float) for v in stats.values())


def test_against_backfill_serve_a_bad_request_is_a_target_error(backfill_server):
    too_long = BenchRequest("r2", 0.0, "online", (5,), "", 10**6)   # past the context length: 400
    with pytest.raises(TargetError, match="HTTP 400"):
        asyncio.run(_collect(HttpTarget(backfill_server, "tiny-random", prompt_as="token_ids"), too_long))


def test_served_model_reads_the_first_listed_and_errors_are_typed(backfill_server, server):
    assert served_model(backfill_server + "/v1/") == "tiny-random"
    with pytest.raises(TargetError, match="no model listed"):
        served_model(server.base_url)   # answers /v1/models with 404
    with pytest.raises(TargetError, match="no model listed"):
        served_model(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)
