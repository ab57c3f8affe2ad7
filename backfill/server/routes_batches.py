"""The Batch API: POST /v1/batches (from an uploaded file), list, read, cancel."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from backfill.server.errors import APIError, bad_request, not_found
from backfill.server.http_helpers import int_param, json_body_openapi, page, read_json
from backfill.server.routes_files import file_not_found
from backfill.server.schemas import BatchCreateBody, validate_body
from backfill.server.state import ServerState


def add_batch_routes(v1: APIRouter, state: ServerState) -> None:
    store, worker = state.store, state.worker

    @v1.post("/batches", openapi_extra=json_body_openapi(BatchCreateBody))
    async def create_batch(request: Request) -> dict:
        body = validate_body(BatchCreateBody, await read_json(request, state.limit_bytes,
                                                  state.config.body_timeout_s))
        file = await asyncio.to_thread(store.get_file, body.input_file_id)
        if file is None:
            raise file_not_found(body.input_file_id, param="input_file_id")
        if file["purpose"] != "batch":
            raise bad_request(f"file {body.input_file_id!r} has purpose {file['purpose']!r}, not 'batch'",
                              param="input_file_id")
        state.check_not_draining()
        batch = await asyncio.to_thread(store.create_batch, body.input_file_id, body.endpoint,
                                        body.completion_window, body.metadata)
        worker.wake()
        return batch

    @v1.get("/batches")
    async def list_batches(request: Request) -> dict:
        limit = int_param(request.query_params.get("limit"), "limit", 20, 1, 100)
        batches, has_more = await asyncio.to_thread(store.list_batches, limit, request.query_params.get("after"))
        return page(batches, has_more)

    async def existing_batch(batch_id: str) -> dict:
        batch = await asyncio.to_thread(store.get_batch, batch_id)
        if batch is None:
            raise not_found(f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        return batch

    @v1.get("/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict:
        return await existing_batch(batch_id)

    @v1.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict:
        status = await asyncio.to_thread(store.request_cancel, batch_id)
        if status is None:
            raise not_found(f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        if status not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {batch_id} is already {status} and cannot be cancelled",
                           code="batch_not_cancellable")
        worker.wake()
        return await existing_batch(batch_id)
