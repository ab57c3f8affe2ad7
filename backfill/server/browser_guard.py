"""Keeps web pages from using the server through the user's browser, as web servers do it.

- DNS rebinding: a page on attacker.example re-points its name at 127.0.0.1 and then reads the
  server as its own origin; its requests carry `Host: attacker.example`. Only the names in the
  Host allow-list are served (default: the bound address and the loopback names; --allowed-hosts).
- Cross-origin requests: a page on another site can POST to 127.0.0.1 without a CORS preflight
  (text/plain, form or multipart bodies); the browser still says where it comes from in
  `Origin`. A request whose Origin is neither the server's own nor in --allowed-origins is
  refused before anything runs. CORS headers (and answers to preflights) exist only for the
  configured origins. JSON endpoints also take only application/json (http_helpers.read_json),
  which no page can send without a preflight.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.server.errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "authorization, content-type, x-request-id, openai-organization, openai-project"
EXPOSED_HEADERS = "x-request-id, retry-after, retry-after-ms"
PREFLIGHT_MAX_AGE_S = 600


def split_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated option -> its non-empty items, stripped."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def host_name(host_header: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """Which Host and Origin values the server answers (see the module docstring)."""

    def __init__(self, bind_host: str, allowed_hosts: str | None, allowed_origins: str | None) -> None:
        extra = split_list(allowed_hosts)
        self.any_host = "*" in extra
        self.hosts = {host_name(h) for h in (bind_host, *LOOPBACK_NAMES, *extra) if h != "*"}
        # Bound to every address: any IP literal names this machine, and an IP literal cannot be
        # rebound (a rebinding page's Host is its own domain name).
        self.any_ip = bind_host in WILDCARD_ADDRESSES
        origins = split_list(allowed_origins)
        self.any_origin = "*" in origins
        self.origins = {o.rstrip("/").lower() for o in origins if o != "*"}

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None or self.any_host:   # no Host: HTTP/1.0, never a browser
            return True
        name = host_name(host_header)
        return name in self.hosts or (self.any_ip and is_ip_literal(name))

    def cors_origin(self, origin: str) -> bool:
        """Whether origin gets CORS headers (configured with --allowed-origins)."""
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        if self.cors_origin(origin):
            return True
        parts = urlsplit(origin)   # same origin: the page was served by this server under this Host
        return host_header is not None and parts.scheme in ("http", "https") \
            and parts.netloc.lower() == host_header.strip().lower()


class BrowserGuardMiddleware:
    """ASGI middleware applying a BrowserGuard to every HTTP request (health and metrics included)."""

    def __init__(self, app: ASGIApp, guard: BrowserGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        host = headers.get("host")
        if not self.guard.host_allowed(host):
            await refuse(send, APIError(403, f"the Host {host!r} is not one this server answers to (a web page "
                                             f"re-pointing its own name at this machine sends such requests); "
                                             f"start the server with --allowed-hosts {host_name(host or '')} "
                                             f"to allow it", code="host_not_allowed"))
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.guard.origin_allowed(origin, host):
            await refuse(send, APIError(403, f"requests from the web origin {origin!r} are not allowed (a page "
                                             f"on another site cannot use this server through a browser); start "
                                             f"the server with --allowed-origins {origin} to allow it",
                                        code="origin_not_allowed"))
            return
        cors = self.guard.cors_origin(origin)
        if cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await send({"type": "http.response.start", "status": 204, "headers": [
                *cors_headers(origin), (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers",
                 (headers.get("access-control-request-headers") or CORS_HEADERS).encode("latin-1")),
                (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors_headers(origin),
                                                  (b"access-control-expose-headers", EXPOSED_HEADERS.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def refuse(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
