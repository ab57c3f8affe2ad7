"""A slow or stalled client cannot hold a connection forever.

uvicorn's keep-alive timer is reset by every byte received, so a client that trickles (or never
finishes) its request headers keeps its connection, and a worker slot, indefinitely. The
protocol here gives each request a fixed deadline for its headers, counted from the moment the
connection is ready for a new request, and closes the connection when it passes. The body has
its own timeout in the app (read_body answers 408).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:   # the headers of the current request are complete
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive within %g s",
                             self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
