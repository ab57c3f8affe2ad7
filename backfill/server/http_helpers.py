"""HTTP helpers shared by every route module: reading bodies (with their limits, deadlines and
media types), list pages and query parameters, disconnect-aware responses.

Browser safety (docs/server.md, "Browsers"): a body is read only if its content-type is the one
the endpoint takes. A page on another site can make a browser POST text/plain, form-encoded or
multipart bodies without a CORS preflight, but never application/json; so JSON endpoints take
only application/json and a cross-site form can reach none of them.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from backfill.server.errors import APIError, bad_request
from backfill.server.multipart import Part, header_params, parse_multipart
from backfill.server.schemas import parse_json
from backfill.server.sse import DONE

JSON_MEDIA_TYPE = "application/json"
MULTIPART_MEDIA_TYPE = "multipart/form-data"


def page(items: list[dict], has_more: bool) -> dict:
    """OpenAI's list object over one page of items."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    """A query parameter as an integer in [low, high], default when absent; 400 naming it otherwise."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", param=name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def require_media_type(request: Request, expected: str) -> None:
    """415 unless the request's content-type is expected (parameters such as charset aside)."""
    raw = request.headers.get("content-type", "")
    media_type, _ = header_params(raw)
    if media_type != expected:
        got = f"content-type {raw!r}" if raw else "no content-type"
        raise APIError(415, f"this endpoint takes {expected} bodies only, got {got}; send content-type: "
                            f"{expected} (no option allows others: a web page on another site can send them "
                            f"through a browser without asking)",
                       code="unsupported_media_type")


async def read_body(request: Request, limit_bytes: int, timeout_s: float | None = None) -> bytes:
    """The whole body, or 413 as soon as it passes the limit (before reading it all when declared),
    or 408 (and the connection closed) when the client stalls for timeout_s between two pieces."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise too_large(limit_bytes)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise bad_request("the client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise too_large(limit_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_json(request: Request, limit_bytes: int, timeout_s: float | None = None) -> object:
    """An application/json body parsed (415 for another media type, 400 for malformed JSON)."""
    require_media_type(request, JSON_MEDIA_TYPE)
    return parse_json(await read_body(request, limit_bytes, timeout_s))


async def read_multipart(request: Request, limit_bytes: int, timeout_s: float | None = None) -> dict[str, Part]:
    """A multipart/form-data body's parts by name (415 for another media type, 400 when malformed)."""
    require_media_type(request, MULTIPART_MEDIA_TYPE)
    body = await read_body(request, limit_bytes, timeout_s)
    return parse_multipart(body, request.headers.get("content-type", ""))


def json_body_openapi(model: type[BaseModel]) -> dict:
    """openapi_extra for a route that reads its JSON body itself (read_json): the body's schema in
    the OpenAPI document, self-contained (its $defs inlined), so clients and fuzzers see it."""
    schema = model.model_json_schema(by_alias=True)
    definitions = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline({**definitions[ref[len("#/$defs/"):]], **{k: v for k, v in node.items() if k != "$ref"}})
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"requestBody": {"required": True, "content": {JSON_MEDIA_TYPE: {"schema": inline(schema)}}}}


def multipart_body_openapi(fields: dict[str, dict], required: list[str]) -> dict:
    """openapi_extra for a route that reads a multipart/form-data body itself (read_multipart)."""
    return {"requestBody": {"required": True, "content": {MULTIPART_MEDIA_TYPE: {"schema": {
        "type": "object", "properties": fields, "required": required}}}}}


def too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit_bytes / 2**20:g} MiB (--max-body-mb)",
                    code="request_too_large")


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[dict]) -> dict:
    """Run work unless the client goes away first (then work is cancelled, and with it the request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        return task.result()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


# The scope key under which ServingApp leaves the ASGI server's send (the one no middleware wraps).
SERVER_SEND = "backfill.server_send"


class ServingApp(FastAPI):
    """FastAPI that leaves the ASGI server's own send in each HTTP scope, for EventStreamResponse's
    body chunks. No middleware here rewrites a response body (they add a header, record the
    status), so past the start message the chunks need none of their send wrappers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class EventStreamResponse(Response):
    """Server-sent events that stop (and run on_close) the moment the client disconnects.

    Starlette's StreamingResponse under ASGI spec 2.4 notices a disconnect only when a write
    fails, i.e. not before the next token; a request waiting in the queue would keep its place.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]) -> None:
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # The body goes to the server's own send: the middlewares' wrappers only look at the
            # start, and each would be one more coroutine per token on the event loop.
            send_body = scope.get(SERVER_SEND, send)
            async for chunk in self.chunks:
                if chunk.endswith(DONE):   # the last events: sent with the end of the body, in one write
                    await send_body({"type": "http.response.body", "body": chunk, "more_body": False})
                    return
                await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
            await send_body({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if streamer.done() and not streamer.cancelled():
                error = streamer.exception()
                if error is not None and not isinstance(error, OSError):  # OSError: the client went away
                    raise error
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.chunks.aclose()
            await self.on_close()
