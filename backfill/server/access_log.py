"""One access-log line per request, and an x-request-id header on every response.

    request_id=req_3f.. POST /v1/chat/completions class=online status=200 prompt_tokens=21
    output_tokens=16 ttft_ms=84.2 duration_ms=512.7

A client's own x-request-id (printable, at most 128 characters) is kept, so a request can be
followed from a gateway's log into ours; otherwise one is made up. The completion handlers
leave what they know (class, token counts, first-token time) in the request's state.
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("backfill.access")
MAX_REQUEST_ID_CHARS = 128


def request_id_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable():
                return text
    return f"req_{uuid.uuid4().hex}"


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            if log.isEnabledFor(logging.INFO):
                log.info("%s", access_line(request_id, scope, state, status[0] if status else 0,
                                           time.monotonic() - started))


def access_line(request_id: str, scope: Scope, state: dict, status: int, duration_s: float) -> str:
    fields = [f"request_id={request_id}", f"{scope.get('method', '-')} {scope.get('path', '-')}",
              f"class={state.get('request_class', '-')}", f"status={status}"]
    generation = state.get("generation")
    if generation is not None:
        ttft = generation.first_token_s - generation.request.arrival_time if generation.first_token_s else None
        fields += [f"prompt_tokens={len(generation.request.prompt_token_ids)}",
                   f"output_tokens={generation.num_output_tokens}",
                   f"ttft_ms={ttft * 1e3:.1f}" if ttft is not None else "ttft_ms=-"]
    fields.append(f"duration_ms={duration_s * 1e3:.1f}")
    return " ".join(fields)
