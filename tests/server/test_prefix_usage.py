"""What a user sees of prefix caching on a live server: usage.prompt_tokens_details.cached_tokens
(responses, the streamed usage chunk, batch output lines) and the two counters on /metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server_helpers import chat_line, live_server, openai_client, upload, wait_final

SYSTEM = "You answer questions about the sea, briefly and kindly. " * 3   # about 170 byte tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("prefix")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _counter(server, name: str, cls: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf'^{name}{{[^}}]*class="{cls}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert m, f"{name} for {cls} not on /metrics"
    return float(m.group(1))


def test_a_shared_system_prompt_is_reported_cached(client, server):
    model = server.state.engine.model_name
    queries = _counter(server, "backfill_prefix_cache_queries_total", "online")
    hits = _counter(server, "backfill_prefix_cache_hits_total", "online")
    first = client.chat.completions.create(model=model, messages=_chat("Why is it salty?"), max_tokens=3)
    second = client.chat.completions.create(model=model, messages=_chat("How deep is it?"), max_tokens=3)
    block = server.state.engine.scheduler.kv.block_size
    shared = len(server.state.engine.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}]))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % block == 0 and shared - block < cached <= shared
    stream = client.chat.completions.create(model=model, messages=_chat("Is it cold?"), max_tokens=3, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == cached
    # Counted in prompt tokens, as vLLM's counters are.
    prompts = first.usage.prompt_tokens + second.usage.prompt_tokens + usage[0].prompt_tokens
    assert _counter(server, "backfill_prefix_cache_queries_total", "online") == queries + prompts
    assert _counter(server, "backfill_prefix_cache_hits_total", "online") == hits + 2 * cached


def test_metrics_show_the_cached_free_blocks_by_eviction_class(client, server):
    model = server.state.engine.model_name
    for question in ("Is it blue?", "Is it wide?"):   # the second finds the system prompt cached
        client.chat.completions.create(model=model, messages=_chat(question), max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'^backfill_prefix_cache_free_blocks\{[^}]*class="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE)}
    pool = server.state.engine.kv_pool
    assert set(found) == {"offline", "online_computed", "online_reused"}
    assert found["online_reused"] >= 1 and sum(found.values()) <= pool.num_cached_free
    assert re.search(r'^backfill_prefix_cache_evictions_total\{[^}]*\} \d', text, re.MULTILINE)


def test_batch_output_lines_report_cached_tokens(client, server):
    lines = [chat_line(f"q{i}", f"question number {i}?", messages=_chat(f"question number {i}?")) for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_final(client, batch.id)
    assert batch.status == "completed"
    records = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    cached = [r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records]
    assert len(cached) == 4 and max(cached) > 0   # the system prompt is cached from the test before or a line
    assert batch.usage.input_tokens_details.cached_tokens == sum(cached)   # the Batch object sums its lines
    assert batch.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in records)
    assert _counter(server, "backfill_prefix_cache_hits_total", "offline") >= sum(cached)
