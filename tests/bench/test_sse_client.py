"""The load generator's streaming client against a real socket server on 127.0.0.1 that writes
scripted HTTP/1.1 responses (split across writes where the test says so)."""

import asyncio
import threading

import pytest

from backfill.bench.sse_client import StreamClient
from backfill.errors import TargetError, WorkloadError


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class ScriptedServer:
    """Each request's path picks a script: a list of byte strings written with a short pause
    between them, then the connection is kept (keep-alive) or closed ("close" in the path)."""

    def __init__(self, scripts: dict[str, list[bytes]]) -> None:
        self.scripts = scripts
        self.connections = 0
        self.requests: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ScriptedServer":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                path = head.split(b" ")[1].decode()
                for piece in self.scripts[path]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.005)
                if "close" in path:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def _run(coro):
    return asyncio.run(coro)


async def _events(client: StreamClient, path: str, body: bytes = b"{}") -> list[bytes]:
    return [data async for _, data in client.events(path, body)]


def test_events_split_across_reads_and_lines():
    stream = _chunked(b'data: {"a": 1}\r\n\r\ndata: li', b'ne one\ndata: line two\n\n', b"data:[DONE]\n\n")
    with ScriptedServer({"/s": [SSE_HEAD + stream[:7], stream[7:30], stream[30:]]}) as server:
        async def go():
            client = StreamClient(server.url + "/", {"Authorization": "Bearer k"})
            try:
                got = [(t, d) async for t, d in client.events("/s", b'{"x": 1}')]
            finally:
                await client.aclose()
            return got
        got = _run(go())
    assert [d for _, d in got] == [b'{"a": 1}', b"line one\nline two", b"[DONE]"]
    assert all(b >= a for (a, _), (b, _) in zip(got, got[1:]))
    request = server.requests[0]
    assert request.startswith(b"POST /s HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in request
    assert request.endswith(b'Content-Length: 8\r\n\r\n{"x": 1}')


def test_keep_alive_reuses_one_connection_and_a_closed_one_is_replaced():
    one = SSE_HEAD + _chunked(b"data: 1\n\n")
    with ScriptedServer({"/s": [one], "/s-close": [one]}) as server:
        async def go():
            client = StreamClient(server.url)
            try:
                first = await _events(client, "/s")
                second = await _events(client, "/s")
                assert server.connections == 1
                await _events(client, "/s-close")   # the server closes the connection after this one
                await asyncio.sleep(0.05)
                third = await _events(client, "/s")   # the pooled connection is gone: a new one
                return first, second, third
            finally:
                await client.aclose()
        assert _run(go()) == ([b"1"], [b"1"], [b"1"])
    assert server.connections == 2


def test_stale_pooled_connection_is_retried_once():
    one = SSE_HEAD + _chunked(b"data: 1\n\n")
    with ScriptedServer({"/s": [one]}) as server:
        async def go():
            client = StreamClient(server.url)
            try:
                await _events(client, "/s")
                # The pooled connection breaks before the client has seen it go (connection_lost comes later).
                client._idle[0].transport.abort()
                return await _events(client, "/s")
            finally:
                await client.aclose()
        assert _run(go()) == [b"1"]


def test_error_status_carries_the_body():
    body = b'{"error": "overloaded"}'
    with ScriptedServer({"/busy": [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body)]}) as server:
        with pytest.raises(TargetError, match='HTTP 503 .*overloaded'):
            _run(_events(StreamClient(server.url), "/busy"))


def test_connection_closed_mid_stream_is_a_target_error():
    partial = SSE_HEAD + b"9\r\ndata: 1\n\n\r\n"
    with ScriptedServer({"/cut-close": [partial]}) as server:
        async def go():
            got = []
            with pytest.raises(TargetError, match="ConnectionResetError"):
                async for _, data in StreamClient(server.url).events("/cut-close", b"{}"):
                    got.append(data)
            return got
        assert _run(go()) == [b"1"]   # what came before the break is delivered


def test_malformed_response_is_a_target_error():
    with ScriptedServer({"/bad": [b"NOT HTTP AT ALL\r\n\r\n"]}) as server:
        with pytest.raises(TargetError, match="malformed HTTP response"):
            _run(_events(StreamClient(server.url), "/bad"))


def test_no_response_within_the_timeout():
    with ScriptedServer({"/silent": []}) as server:
        with pytest.raises(TargetError, match="within 0.2 s"):
            _run(_events(StreamClient(server.url, timeout_s=0.2), "/silent"))


def test_stopping_early_closes_the_connection_instead_of_pooling_it():
    many = [SSE_HEAD] + [b"9\r\ndata: 1\n\n\r\n"] * 20 + [b"0\r\n\r\n"]
    with ScriptedServer({"/long": many}) as server:
        async def go():
            client = StreamClient(server.url)
            events = client.events("/long", b"{}")
            async for _ in events:
                break
            await events.aclose()
            idle = len(client._idle)
            await client.aclose()
            return idle
        assert _run(go()) == 0


def test_get_returns_status_and_body_and_refused_connect():
    with ScriptedServer({"/metrics": [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nx 1.0"]}) as server:
        assert _run(StreamClient(server.url).get("/metrics")) == (200, b"x 1.0")
    with pytest.raises(TargetError, match="Connect to 127.0.0.1:"):
        _run(StreamClient(server.url).get("/metrics"))   # the server has stopped


def test_bad_url():
    with pytest.raises(WorkloadError):
        StreamClient("localhost:8000")
