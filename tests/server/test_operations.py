"""Slow clients are cut off, every 429 says when to retry, every request is logged with its id,
and the metrics cover tokens, end-to-end latency and the offline backlog."""

from __future__ import annotations

import importlib.util
import logging
import socket
import threading
import time

import httpx
import pytest

from server_helpers import chat_line, live_server, sample_value, openai_client, upload, wait_final


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; (data, seconds it took)."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


# Both HTTP parsers carry the header deadline (server/http_timeouts.py); httptools where installed.
PARSERS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    importlib.util.find_spec("httptools") is None, reason="httptools is not installed"))]


@pytest.fixture(scope="module", params=PARSERS)
def server_process(tmp_path_factory, request):
    from server_helpers import ServerProcess

    proc = ServerProcess(tmp_path_factory.mktemp("ops") / "s.db", None, "--header-timeout-s", "1",
                         "--body-timeout-s", "1", "--log-level", "info", "--http-parser", request.param)
    try:
        yield proc.wait_ready(timeout_s=240)   # generous: CI machines can be slow to import torch
    finally:
        proc.stop()


def test_unfinished_headers_are_closed_after_the_header_timeout(server_process):
    with socket.create_connection(("127.0.0.1", server_process.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # never the blank line
        data, took_s = read_until_closed(sock, limit_s=15)
    assert data == b"" and took_s < 10


def test_trickled_headers_do_not_reset_the_deadline(server_process):
    with socket.create_connection(("127.0.0.1", server_process.port)) as sock:
        sock.settimeout(15)
        started = time.monotonic()
        try:
            for _ in range(40):   # a byte every 0.25 s for 10 s; the deadline is 1 s
                sock.sendall(b"X")
                time.sleep(0.25)
        except OSError:
            pass                  # closed under us: what should happen
        assert time.monotonic() - started < 10 or sock.recv(10) == b""


def test_an_idle_keep_alive_connection_gets_the_header_deadline_again(server_process):
    with socket.create_connection(("127.0.0.1", server_process.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data, took_s = read_until_closed(sock, limit_s=15)
    # The response, then the close at the 1 s header deadline, before uvicorn's 5 s keep-alive.
    assert data.startswith(b"HTTP/1.1 200") and took_s < 4


def test_unknown_or_missing_parser_and_loop_are_config_errors(monkeypatch):
    from backfill.errors import ServerConfigError
    from backfill.server.config import ServerConfig
    from backfill.server import http_timeouts

    with pytest.raises(ServerConfigError, match="http_parser"):
        ServerConfig(http_parser="picohttp")
    with pytest.raises(ServerConfigError, match="event_loop"):
        ServerConfig(event_loop="trio")
    with pytest.raises(ServerConfigError, match="http_parser"):
        http_timeouts.resolve_http_parser("picohttp")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvloop", "httptools") else real_find_spec(name, *a))
    assert http_timeouts.resolve_event_loop("auto") == "asyncio"
    assert http_timeouts.resolve_http_parser("auto") == "h11"
    with pytest.raises(ServerConfigError, match="uvloop package is not installed"):
        http_timeouts.resolve_event_loop("uvloop")
    with pytest.raises(ServerConfigError, match="httptools package is not installed"):
        http_timeouts.header_timeout_protocol(1.0, "httptools")


def test_short_body_gets_408_and_the_connection_closes(server_process):
    with socket.create_connection(("127.0.0.1", server_process.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\n\r\n{\"a\":")   # 5 of the 10 bytes
        data, took_s = read_until_closed(sock, limit_s=15)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and took_s < 10
    assert httpx.get(f"{server_process.url}/health").status_code == 200   # the server is fine


def test_access_log_line_and_request_id(server_process):
    response = httpx.post(f"{server_process.url}/v1/completions", headers={"x-request-id": "trace-42"},
                          json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
    generated = httpx.get(f"{server_process.url}/v1/models").headers["x-request-id"]
    assert generated.startswith("req_")
    deadline = time.monotonic() + 10
    while "request_id=trace-42" not in server_process.log():
        assert time.monotonic() < deadline, server_process.log()
        time.sleep(0.1)
    line = next(line for line in server_process.log().splitlines() if "request_id=trace-42" in line)
    for part in ("POST /v1/completions", "class=online", "status=200", "prompt_tokens=", "output_tokens=3",
                 "ttft_ms=", "duration_ms="):
        assert part in line, line


def test_every_429_has_retry_after(tmp_path):
    with live_server(tmp_path, max_online_queue=1) as server:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as first:
            assert first.status_code == 200
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert int(refused.headers["retry-after"]) >= 1
            # openai-python reads retry-after-ms first; the SLO 429 sends it, so must the queue cap.
            assert int(refused.headers["retry-after-ms"]) == 1000 * int(refused.headers["retry-after"])


def test_metrics_tokens_latency_and_backlog(tmp_path):
    with live_server(tmp_path) as server:
        client = openai_client(server.url)
        out = client.completions.create(model=None, prompt="one two three", max_tokens=2)
        batch = client.batches.create(input_file_id=upload(client, [chat_line("a"), chat_line("b")]).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_final(client, batch.id)
        text = httpx.get(f"{server.url}/metrics").text
        assert sample_value(text, "backfill_prompt_tokens_total", **{"class": "online"}) == out.usage.prompt_tokens
        assert sample_value(text, "backfill_e2e_request_latency_seconds_count", **{"class": "online"}) == 1
        assert sample_value(text, "backfill_e2e_request_latency_seconds_count", **{"class": "offline"}) == 2
        assert sample_value(text, "backfill_batches", status="completed") == 1
        assert sample_value(text, "backfill_batch_lines_waiting") == 0


def test_ready_says_warming_up_while_decode_buckets_compile(tmp_path):
    from backfill.engine.compiled_decode import CompiledDecode

    with live_server(tmp_path) as server:
        model = server.state.engine.scheduler.runner.model
        assert httpx.get(f"{server.url}/ready").status_code == 200
        # A compile thread still running, as compile_buckets(background=True) leaves one after load.
        done = threading.Event()
        compiled = CompiledDecode.__new__(CompiledDecode)
        compiled._bucket_thread = threading.Thread(target=done.wait, daemon=True)
        compiled._bucket_thread.start()
        model.compiled_decode = compiled
        try:
            response = httpx.get(f"{server.url}/ready")
            assert response.status_code == 503 and response.json()["status"] == "warming_up"
            assert httpx.get(f"{server.url}/health").status_code == 200
            # Requests are served meanwhile: only readiness waits for the warm-up.
            assert httpx.get(f"{server.url}/v1/models").status_code == 200
        finally:
            done.set()
            compiled._bucket_thread.join(5)
            model.compiled_decode = None
        assert httpx.get(f"{server.url}/ready").json()["status"] == "ok"
