"""The load generator's HTTP/1.1 client: a POST whose server-sent events arrive as they are sent.

The load generator shares the machine with the server it measures, so every microsecond it
spends on a streamed token is taken from the server under test. aiohttp reads an event stream a
line at a time, each line a coroutine wake-up through its StreamReader; here the response is
parsed by httptools (the C parser uvicorn uses) inside the protocol's data_received, the events
of one read are split there and queued with the time the bytes arrived, and the consumer wakes
once per read, not once per line (docs/peers.md measures the CPU a token of both).

Connections are kept alive and reused, as aiohttp's pool does: a request on a pooled connection
that the server closed meanwhile (its keep-alive timeout) is sent again once on a new one, as
long as no byte of a response came back.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from backfill.errors import TargetError, WorkloadError

Event = tuple[float, bytes]   # (monotonic receive time in s, the event's data)


class _Connection(asyncio.Protocol):
    """One keep-alive connection serving one request at a time; httptools calls the on_* methods."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self, stream_events: bool = True) -> None:
        self.stream_events = stream_events
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.error: BaseException | None = None
        self.received_any = False
        self.events: deque[Event] = deque()
        self.body = bytearray()      # a body not read as events (a GET's, a non-200's), kept whole
        self._pending = bytearray()  # SSE bytes not yet ended by a newline
        self._data: list[bytes] = []  # the data lines of the event being read
        self._now = 0.0

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._now = time.monotonic()
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = TargetError(f"malformed HTTP response: {exc}")
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = ConnectionResetError(str(exc) if exc else "the server closed the connection")
        self._wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()   # llhttp forgets it once the message completes
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.status != 200 or not self.stream_events:
            self.body += body
            return
        self._pending += body
        start = 0
        while (end := self._pending.find(b"\n", start)) >= 0:
            line = bytes(self._pending[start:end]).rstrip(b"\r")
            start = end + 1
            if line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif not line and self._data:   # a blank line ends an event (SSE)
                self.events.append((self._now, self._data[0] if len(self._data) == 1 else b"\n".join(self._data)))
                self._data = []
        del self._pending[:start]

    def on_message_complete(self) -> None:
        self.complete = True

    # the consumer's side
    def start(self, request: bytes, stream_events: bool = True) -> None:
        self._reset(stream_events)
        self.transport.write(request)

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.keep_alive

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class StreamClient:
    """POSTs JSON to one server and yields its events: `async for when, data in client.events(path, body)`.

    Connections belong to the event loop that opened them; aclose() closes the idle ones.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, *, max_connections: int = 1024,
                 connect_timeout_s: float = 30.0, timeout_s: float = 6 * 3600.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WorkloadError(f"base_url must be an http(s) URL with a host, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host_header}\r\nConnection: keep-alive\r\n{extra}"
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _for_loop(self) -> asyncio.Semaphore:
        """The connection slots of the running loop; a new asyncio.run starts with no pooled connections."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._slots is None:
            self._idle, self._loop = [], loop
            self._slots = asyncio.Semaphore(self._max_connections)
        return self._slots

    def _request(self, method: str, path: str, body: bytes, accept: str) -> bytes:
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}Accept: {accept}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode("latin-1") + body

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self._ssl), self._connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise TargetError(f"Connect to {self.host}:{self.port} failed: {type(exc).__name__}: {exc}") from None
        return conn

    async def events(self, path: str, body: bytes, accept: str = "text/event-stream") -> AsyncIterator[Event]:
        """The events of POST path, as (receive time, data) in order. TargetError on a status other
        than 200 (with the body), a broken connection or the timeout."""
        request = self._request("POST", path, body, accept)
        async with self._for_loop():
            conn = await self._connect()
            conn.start(request)
            timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire, conn)
            try:
                while True:
                    while conn.events:
                        yield conn.events.popleft()
                    if conn.error is not None:
                        if isinstance(conn.error, ConnectionResetError) and not conn.received_any \
                                and not conn.headers_done:   # a pooled connection the server had closed: once more
                            conn.close()
                            conn = await self._connect()
                            conn.start(request)
                            continue
                        raise conn.error if isinstance(conn.error, TargetError) else \
                            TargetError(f"{type(conn.error).__name__} talking to {self.host}:{self.port}: {conn.error}")
                    if conn.complete:
                        if conn.status != 200:
                            text = bytes(conn.body).decode("utf-8", errors="replace")
                            raise TargetError(f"HTTP {conn.status} from {self.host}:{self.port}: {text[:500]}")
                        return
                    await conn.wait()
            finally:
                timer.cancel()
                self._release(conn)

    async def get(self, path: str) -> tuple[int, bytes]:
        """A plain GET: (status, body)."""
        request = f"GET {self.prefix}{path} HTTP/1.1\r\n{self._head}\r\n".encode("latin-1")
        async with self._for_loop():
            conn = await self._connect()
            conn.start(request, stream_events=False)
            try:
                while not conn.complete:
                    if conn.error is not None:
                        raise TargetError(f"{type(conn.error).__name__} talking to {self.host}:{self.port}")
                    await asyncio.wait_for(conn.wait(), self._connect_timeout_s)
            finally:
                self._release(conn)
        return conn.status, bytes(conn.body)

    def _release(self, conn: _Connection) -> None:
        if conn.reusable():
            self._idle.append(conn)
        else:   # stopped early, failed or not keep-alive: the rest of the response is unwanted
            conn.close()

    def _expire(self, conn: _Connection) -> None:
        conn.error = TargetError(f"no complete response from {self.host}:{self.port} within {self._timeout_s:g} s")
        conn._wake()

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle = []
