"""The online endpoints on a live server, driven by the official openai client."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from server_helpers import LiveServer, assert_error, live_server, openai_client

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("app")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def model(server):
    return server.state.engine.model_name


def metric(server, name: str, **labels) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(part in (m.group(1) or "") for part in wanted.split(",") if part):
            return float(m.group(2))
    raise AssertionError(f"{name}{{{wanted}}} not in /metrics")


def test_models_list(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert client.models.retrieve(model).id == model


def test_chat_non_streaming_counts_usage(client, server, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = server.state.engine.tokenizer.encode_chat(CHAT)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.service_tier == "default"


def test_chat_streaming_matches_non_streaming(client, model):
    kwargs = dict(model=model, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_prompts(client, server, model):
    reply = client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    ids = server.state.engine.tokenizer.encode("Once upon")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == reply.choices[0].text
    streamed = list(client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_stop_string_cuts_output(client, model):
    kwargs = dict(model=model, prompt="abc", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = next(ch for ch in full[4:] if ch.strip() and ch != "\ufffd")
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_seeded_sampling_is_reproducible(client, model):
    kwargs = dict(model=model, prompt="xyz", max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_flex_tier_runs_as_offline(client, server, model):
    before = metric(server, "backfill_time_to_first_token_seconds_count", **{"class": "offline"})
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, service_tier="flex")
    assert reply.service_tier == "flex"
    assert metric(server, "backfill_time_to_first_token_seconds_count", **{"class": "offline"}) == before + 1


def test_metrics_expose_scheduler_counters(client, server, model):
    client.completions.create(model=model, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("backfill_time_to_first_token_seconds_bucket", "backfill_time_per_output_token_seconds_bucket",
                 "backfill_queue_length", "backfill_kv_cache_usage_ratio", "backfill_preemptions_total",
                 "backfill_preempted_requests_total", "backfill_checkpointed_tokens_total",
                 "backfill_restored_tokens_total", "backfill_recomputed_tokens_total",
                 "backfill_batch_lines_in_flight"):
        assert name in text, name
    assert metric(server, "backfill_output_tokens_total", **{"class": "online"}) >= 2
    assert re.search(r'backfill_queue_length\{[^}]*class="offline"[^}]*\}', text)


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_stream_disconnect_cancels_request(server, model):
    cancelled = metric(server, "backfill_requests_total", **{"class": "online", "finish_reason": "cancelled"})
    body = {"model": model, "prompt": "go", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    scheduler = server.state.engine.scheduler
    _wait_until(lambda: not scheduler.seqs)
    assert metric(server, "backfill_requests_total", **{"class": "online", "finish_reason": "cancelled"}) \
        == cancelled + 1


def test_non_streaming_disconnect_cancels_request(server, model):
    cancelled = metric(server, "backfill_requests_total", **{"class": "online", "finish_reason": "cancelled"})
    body = json.dumps({"model": model, "prompt": "go", "max_tokens": 500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait_until(lambda: server.state.in_flight["online"] == 1)
    scheduler = server.state.engine.scheduler
    _wait_until(lambda: not scheduler.seqs and server.state.in_flight["online"] == 0)
    assert metric(server, "backfill_requests_total", **{"class": "online", "finish_reason": "cancelled"}) \
        == cancelled + 1


def test_online_queue_bound_gives_429(tmp_path):
    with live_server(tmp_path, max_online_queue=1) as srv:
        model = srv.state.engine.model_name
        body = {"model": model, "prompt": "go", "max_tokens": 500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()   # kept referenced: a collected iterator closes the stream
            assert next(lines).startswith("data: ")
            error = assert_error(httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False}), 429,
                                 code="queue_full")
            assert "retry" in error["message"]
            with pytest.raises(openai.RateLimitError):
                openai_client(srv.url).completions.create(model=model, prompt="x", max_tokens=1)
            # flex requests have their own bound, so a full online queue does not block them (with the
            # default interference cap the flex request may only finish once the online one is done)
            assert srv.state.in_flight["online"] == 1
            flex = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                                  "service_tier": "flex"})
            assert flex.status_code == 200
        _wait_until(lambda: srv.state.in_flight["online"] == 0)
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


def test_api_key_required_on_v1(tmp_path):
    with live_server(tmp_path, api_key="s3cret") as srv:
        with pytest.raises(openai.AuthenticationError):
            openai_client(srv.url, api_key="wrong").models.list()
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401, code="invalid_api_key")
        assert openai_client(srv.url, api_key="s3cret").models.list().data
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_draining_server_refuses_new_work(tmp_path):
    with live_server(tmp_path) as srv:
        srv.state.begin_drain()
        ready = httpx.get(f"{srv.url}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{srv.url}/health").status_code == 200   # alive: not a reason to restart it
        assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}), 503,
                     code="service_unavailable")


@pytest.mark.slow
def test_real_default_model_answers_through_the_chat_template(tmp_path):
    from backfill.server.app import create_app
    from backfill.server.config import ServerConfig
    from backfill.server.store import Store
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_engine

    serving = ServingConfig(policy="fcfs")   # fcfs needs no latency profile
    app = create_app(build_engine(serving), ServerConfig(serving=serving, db=str(tmp_path / "r.db")),
                     Store(tmp_path / "r.db"))
    with LiveServer(app) as srv:
        client = openai_client(srv.url)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
