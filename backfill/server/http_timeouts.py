"""A slow or stalled client cannot hold a connection forever.

uvicorn's keep-alive timer is reset by every byte received, so a client that trickles (or never
finishes) its request headers keeps its connection, and a worker slot, indefinitely. The
protocols here give each request a fixed deadline for its headers, counted from the moment the
connection is ready for a new request, and close the connection when it passes. The body has
its own timeout in the app (read_body answers 408).

Both of uvicorn's HTTP/1.1 protocols get the deadline: httptools (a C parser, installed with
`uvicorn[standard]`), which costs the event loop less per request and per streamed chunk, and
h11 (pure Python), the fallback where httptools is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from backfill.errors import ServerConfigError
from backfill.server.config import EVENT_LOOPS, HTTP_PARSERS


class _HeaderDeadline:
    """The timer both protocols share; each says when a request's headers are awaited."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive within %g s",
                             self.header_timeout_s)
            self.transport.close()

    # Cooperative overrides: the mixin comes first in each protocol's bases, so super() is uvicorn's.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting_headers():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


class HeaderTimeoutProtocol(_HeaderDeadline, H11Protocol):
    """h11: the peer's state is IDLE until a request's headers are complete."""

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def handle_events(self) -> None:
        super().handle_events()
        if not self._awaiting_headers():   # the headers of the current request are complete
            self._disarm_header_timer()


def _httptools_protocol() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeoutProtocol(_HeaderDeadline, HttpToolsProtocol):
        """httptools: headers are awaited while no request is in flight (the last request's
        response is complete and none is pipelined behind it)."""

        def _awaiting_headers(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

    return HttpToolsHeaderTimeoutProtocol


def _resolve(knob: str, name: str, allowed: tuple[str, ...], fast: str, fallback: str) -> str:
    """auto -> the fast one where its package is installed, else the fallback; the fast one asked
    for by name but not installed is an error, not a silent fallback."""
    if name not in allowed:
        raise ServerConfigError(f"{knob} must be one of {', '.join(allowed)}, got {name!r}")
    installed = importlib.util.find_spec(fast) is not None
    if name == "auto":
        return fast if installed else fallback
    if name == fast and not installed:
        raise ServerConfigError(f"{knob} {fast}: the {fast} package is not installed (pip install 'uvicorn[standard]')")
    return name


def resolve_http_parser(name: str) -> str:
    return _resolve("http_parser", name, HTTP_PARSERS, "httptools", "h11")


def resolve_event_loop(name: str) -> str:
    return _resolve("event_loop", name, EVENT_LOOPS, "uvloop", "asyncio")


def header_timeout_protocol(header_timeout_s: float, parser: str = "h11") -> type:
    """The protocol class to give uvicorn.Config(http=...), on the resolved parser."""
    base = _httptools_protocol() if resolve_http_parser(parser) == "httptools" else HeaderTimeoutProtocol
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})
