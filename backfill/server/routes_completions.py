"""POST /v1/chat/completions and /v1/completions: online requests, admitted, streamed or not,
cancelled the moment the client disconnects."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from backfill.server.completions import Kind
from backfill.server.http_helpers import EventStreamResponse, json_body_openapi, read_json, until_disconnected
from backfill.server.schemas import ChatCompletionBody, CompletionBody
from backfill.server.state import ServerState


def add_completion_routes(v1: APIRouter, state: ServerState) -> None:
    service = state.service

    async def generate(request: Request, kind: Kind) -> Response:
        arrived = time.monotonic()
        data = await read_json(request, state.limit_bytes, state.config.body_timeout_s)
        prepared = service.prepare(kind, data, arrival_time=arrived)
        request_class = prepared.request.request_class.value
        request.state.request_class = request_class
        request.state.model = prepared.model
        admitted = state.admit(prepared)
        try:
            # The span carries the access log's request id and OpenTelemetry's GenAI attributes.
            generation = service.submit(prepared, trace_carrier=request.headers, trace_attributes={
                "backfill.request_id": request.state.request_id, "gen_ai.response.id": prepared.response_id,
                "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
                "gen_ai.request.model": prepared.model})
        except BaseException:
            state.release(request_class)
            raise
        state.track(generation, admitted)
        request.state.generation = generation   # for the access log

        async def close() -> None:
            await generation.aclose()
            state.release(request_class, generation)

        if prepared.stream:
            return EventStreamResponse(service.stream_sse(prepared, generation), close)
        try:
            return JSONResponse(await until_disconnected(request.receive, service.complete(prepared, generation)))
        finally:
            await close()

    @v1.post("/chat/completions", openapi_extra=json_body_openapi(ChatCompletionBody))
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @v1.post("/completions", openapi_extra=json_body_openapi(CompletionBody))
    async def completions(request: Request) -> Response:
        return await generate(request, "text")
