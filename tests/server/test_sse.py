"""Streamed chunks built from the per-request template (backfill/server/sse.py) are byte for byte
what serialising the chunk object (completions.chunk_body) gives: for any text, delta, logprobs
and finish reason, and through the real app for plain text, logprobs, tool calls and n > 1."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import close_app, live_server, make_app

from backfill.sampling_params import SamplingParams, TokenLogprob
from backfill.server.completions import Prepared, chunk_body, logprobs_object
from backfill.server.sse import DONE, ChunkTemplate
from backfill.types import GenerationRequest, RequestClass

# Detokenized text never holds lone surrogates (they cannot be encoded as UTF-8 at all).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}


def prepared(kind: str, *, model: str = "m", response_id: str = "cmpl-1", created: int = 1,
             include_usage: bool = False, offline: bool = False) -> Prepared:
    request = GenerationRequest([1, 2], SamplingParams(max_tokens=4),
                                RequestClass.OFFLINE if offline else RequestClass.ONLINE, request_id=response_id)
    return Prepared(kind, [request], model, response_id, created, True, include_usage)


def serialised(p: Prepared, *args) -> bytes:
    return b"data: " + json.dumps(chunk_body(p, *args), ensure_ascii=False).encode() + b"\n\n"


def logprobs_of(kind: str, text: str) -> dict:
    tokens = {1: text, 2: text[::-1] + '"', 3: "\u00e9\n"}
    return logprobs_object(kind, [TokenLogprob(1, -0.25, ((1, -0.25), (2, -1.5))), TokenLogprob(3, -3.0, ())],
                           tokens.__getitem__)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["chat", "text"]), text=TEXT, model=TEXT, response_id=TEXT,
       created=st.integers(0, 2**40), include_usage=st.booleans(), offline=st.booleans(),
       index=st.integers(0, 127), reason=st.sampled_from([None, "stop", "length", "tool_calls"]),
       with_logprobs=st.booleans())
def test_template_equals_serialising_the_chunk(kind, text, model, response_id, created, include_usage, offline,
                                               index, reason, with_logprobs):
    p = prepared(kind, model=model, response_id=response_id, created=created, include_usage=include_usage,
                 offline=offline)
    logprobs = logprobs_of(kind, text) if with_logprobs else None
    assert ChunkTemplate(p).event(text, reason, index, logprobs) == serialised(p, text, reason, index, logprobs)


@pytest.mark.parametrize("delta", [
    {"role": "assistant", "content": ""}, {"content": "x\u2028\"y"}, {},
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]},
    {"tool_calls": [{"index": 1, "function": {"arguments": "{\"city\": \"Oslo\"}"}}]},
])
def test_template_equals_serialising_a_dict_delta(delta):
    p = prepared("chat", include_usage=True)
    assert ChunkTemplate(p).event(delta, None, 1) == serialised(p, delta, None, 1)
    assert ChunkTemplate(p).event(delta, "tool_calls", 0) == serialised(p, delta, "tool_calls", 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("sse"), max_model_len=2048) as srv:
        yield srv


def events(server, path: str, body: dict) -> list[bytes]:
    """The raw data of every SSE event of a streamed response."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        raw = response.read()
    assert raw.endswith(b"\n\n")
    out = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        out.append(event[len(b"data: "):])
    return out


def check_chunks(kind: str, data: list[bytes], include_usage: bool) -> list[dict]:
    """Every chunk is the serialisation of the object chunk_body gives for its fields; returns them."""
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    for raw, chunk in zip(data, chunks):
        if not chunk["choices"]:   # the usage chunk
            assert include_usage and chunk is chunks[-1] and chunk["usage"]["completion_tokens"] > 0
            continue
        (choice,) = chunk["choices"]
        p = prepared(kind, model=chunk["model"], response_id=chunk["id"], created=chunk["created"],
                     include_usage="usage" in chunk, offline=chunk["service_tier"] == "flex")
        delta = choice["delta"] if kind == "chat" else choice["text"]
        expected = chunk_body(p, delta, choice["finish_reason"], choice["index"], choice["logprobs"])
        assert raw == json.dumps(expected, ensure_ascii=False).encode()
    assert ("usage" in chunks[0]) == include_usage
    return [c for c in chunks if c["choices"]]


@pytest.mark.parametrize("kind, path, body", [
    ("text", "/v1/completions", {"prompt": "Once upon", "max_tokens": 12, "ignore_eos": True,
                                 "stream_options": {"include_usage": True}}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \u00e9"}], "max_tokens": 12,
                                      "ignore_eos": True}),
    ("text", "/v1/completions", {"prompt": "a b", "max_tokens": 6, "logprobs": 2, "ignore_eos": True}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                      "logprobs": True, "top_logprobs": 2, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}}),
    ("text", "/v1/completions", {"prompt": "a b c", "max_tokens": 5, "n": 3, "ignore_eos": True,
                                 "service_tier": "flex", "stream_options": {"include_usage": True}}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
                                      "ignore_eos": True}),
])
def test_streams_through_the_app(server, kind, path, body):
    include_usage = bool(body.get("stream_options"))
    chunks = check_chunks(kind, events(server, path, {**body, "seed": 7, "temperature": 1.0}), include_usage)
    n = body.get("n", 1)
    assert sorted({c["choices"][0]["index"] for c in chunks}) == list(range(n))
    finished = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finished) == n and all(c["choices"][0]["finish_reason"] == "length" for c in finished)
    if body.get("logprobs"):
        assert any(c["choices"][0]["logprobs"] for c in chunks)
    # The same request unstreamed: the streamed pieces add up to its text.
    unstreamed = {k: v for k, v in body.items() if k != "stream_options"}
    whole = httpx.post(f"{server.url}{path}", json={**unstreamed, "seed": 7, "temperature": 1.0}, timeout=120).json()
    for choice in whole["choices"]:
        pieces = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        if kind == "chat":
            assert "".join(p["delta"].get("content", "") for p in pieces) == choice["message"]["content"]
        else:
            assert "".join(p["text"] for p in pieces) == choice["text"]


def test_tool_call_deltas_through_the_app(server):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 120, "tools": [WEATHER],
            "tool_choice": "required", "seed": 3, "stream_options": {"include_usage": True}}
    chunks = check_chunks("chat", events(server, "/v1/chat/completions", body), True)
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", ())]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("tool_calls", "length")


class SeenByMiddleware:
    """A middleware that records the messages passing through its send wrapper."""

    def __init__(self, app, seen: list[dict]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        async def recording(message: dict) -> None:
            self.seen.append(message)
            await send(message)
        await self.app(scope, receive, recording)


async def asgi_stream(app, path: str, body: dict) -> list[dict]:
    """POST a streamed request straight into the app: the messages it sends the server."""
    raw = json.dumps({**body, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5555)}
    received = asyncio.Event()
    outer: list[dict] = []

    async def receive() -> dict:
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()   # the client stays

    async def send(message: dict) -> None:
        outer.append(message)

    await app(scope, receive, send)
    return outer


@pytest.mark.parametrize("path, body, last_events", [
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 6, "ignore_eos": True,
                         "stream_options": {"include_usage": True}}, 3),   # last chunk, usage, [DONE]
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
                              "ignore_eos": True}, 2),
])
def test_body_chunks_go_to_the_server_send_and_the_last_events_end_the_body(tmp_path, path, body, last_events):
    seen: list[dict] = []

    async def go() -> list[dict]:
        app = make_app(tmp_path / "asgi.db")
        app.add_middleware(SeenByMiddleware, seen=seen)
        await app.state.backfill.engine.start()
        try:
            return await asgi_stream(app, path, body)
        finally:
            await app.state.backfill.engine.stop()
            close_app(app)
    messages = asyncio.run(go())
    start, *bodies = messages
    # Only the start passes the middlewares' send wrappers; the body goes to the server's own send.
    assert [m["type"] for m in seen] == ["http.response.start"]
    assert start["type"] == "http.response.start" and start["status"] == 200
    # The start went through the middlewares (the access log adds its header) ...
    assert any(name == b"x-request-id" for name, _ in start["headers"])
    # ... and every body message is whole events; the last ends the body with the final events and [DONE].
    assert all(m["type"] == "http.response.body" and m["body"].endswith(b"\n\n") for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    last = bodies[-1]["body"]
    assert last.endswith(DONE) and last.count(b"data: ") == last_events
    data = b"".join(m["body"] for m in bodies)[:-2].split(b"\n\n")
    kind = "chat" if "chat" in path else "text"
    chunks = check_chunks(kind, [d[len(b"data: "):] for d in data], "stream_options" in body)
    finished = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finished) == body.get("n", 1)
