"""One access-log line per request, an x-request-id header on every response, and the HTTP
status counters.

    request_id=req_3f.. POST /v1/chat/completions status=200 client=127.0.0.1:50312 model=smollm2
    class=online trace_id=4bf9.. prompt_tokens=21 output_tokens=16 ttft_ms=84.2 duration_ms=512.7

With --log-format json the same fields are the keys of one JSON object (server/logs.py). A
client's own x-request-id (printable, at most 128 characters) is kept, so a request can be
followed from a gateway's log into ours; otherwise one is made up. The trace id is the request's
span's when traces are exported, else the caller's `traceparent`'s, so a line joins its trace.
Probes and scrapes (/health, /ready, /metrics, /dashboard/data) log at DEBUG: every few seconds
from every prober, they would bury the requests. The completion handlers leave what they know
(class, model, token counts, first-token time) in the request's state.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from backfill.server.metrics import ServerMetrics

log = logging.getLogger("backfill.access")
MAX_REQUEST_ID_CHARS = 128
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", "/dashboard/data"})
UNMATCHED_ROUTE = "unmatched"   # the handler label of a request no route took (404s of scanners)
# The methods counted by name; any other a client sends counts as "other" (label values stay bounded).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def request_id_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable():
                return text
    return f"req_{uuid.uuid4().hex}"


def route_of(scope: Scope) -> str:
    """The route's path template (bounded label values), not the path asked for."""
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED_ROUTE


def caller_trace_id(scope: Scope) -> str | None:
    """The trace id of a W3C traceparent header (version-traceid-spanid-flags), if well formed."""
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            parts = value.decode("latin-1").split("-")
            if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
                return parts[1].lower()
    return None


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        started = time.monotonic()
        status: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            duration_s = time.monotonic() - started
            code = status[0] if status else 0
            if self.metrics is not None:
                method = scope.get("method", "")
                self.metrics.observe_http(method if method in HTTP_METHODS else "other", route_of(scope), code,
                                          duration_s)
            level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
            if log.isEnabledFor(level):
                fields = access_fields(request_id, scope, state, code, duration_s)
                log.log(level, "%s", access_line(fields), extra={"fields": fields})


def access_fields(request_id: str, scope: Scope, state: dict, status: int, duration_s: float) -> dict[str, Any]:
    client = scope.get("client")
    generation = state.get("generation")
    trace_id = getattr(generation, "trace_id", None) or caller_trace_id(scope)
    fields: dict[str, Any] = {"request_id": request_id, "method": scope.get("method", "-"),
                              "path": scope.get("path", "-"), "status": status,
                              "client": f"{client[0]}:{client[1]}" if client else None,
                              "model": state.get("model"), "class": state.get("request_class"),
                              "trace_id": trace_id}
    if generation is not None:
        first = generation.first_token_s
        fields.update(prompt_tokens=len(generation.request.prompt_token_ids),
                      output_tokens=generation.num_output_tokens,
                      ttft_ms=round((first - generation.request.arrival_time) * 1e3, 3) if first else None)
    fields["duration_ms"] = round(duration_s * 1e3, 3)
    return fields


def access_line(fields: dict[str, Any]) -> str:
    """The text form: key=value, the method and path bare, '-' for what is not known."""
    parts = [f"request_id={fields['request_id']}", f"{fields['method']} {fields['path']}"]
    for key, value in fields.items():
        if key not in ("request_id", "method", "path"):
            parts.append(f"{key}={'-' if value is None else value}")
    return " ".join(parts)
