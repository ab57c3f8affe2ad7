"""The Files API: POST /v1/files (multipart upload), list, read, download, delete."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from backfill.server.errors import bad_request, not_found
from backfill.server.fine_tuning import FINE_TUNE_PURPOSE
from backfill.server.http_helpers import int_param, multipart_body_openapi, page, read_multipart
from backfill.server.state import ServerState

UPLOAD_PURPOSES = ("batch", FINE_TUNE_PURPOSE)


UPLOAD_PARTS = ("purpose", "file")   # the parts of POST /v1/files' multipart body


def add_file_routes(v1: APIRouter, state: ServerState) -> None:
    store = state.store

    @v1.post("/files", openapi_extra=multipart_body_openapi(
        {"purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}, "file": {"type": "string", "format": "binary"}},
        ["purpose", "file"]))
    async def upload_file(request: Request) -> dict:
        parts = await read_multipart(request, state.limit_bytes, state.config.body_timeout_s)
        for name in parts:   # as in the JSON bodies: a misspelt part is refused, never ignored
            if name not in UPLOAD_PARTS:
                raise bad_request(f"{name}: unknown field; this endpoint takes {' and '.join(UPLOAD_PARTS)}",
                                  param=name)
        purpose = parts.get("purpose")
        if purpose is None:
            raise bad_request("purpose is required", param="purpose")
        purpose_text = purpose.data.decode("utf-8", "replace").strip()
        if purpose_text not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose {purpose_text!r} is not supported; this server accepts 'batch' and "
                              f"'{FINE_TUNE_PURPOSE}'", param="purpose")
        upload = parts.get("file")
        if upload is None or upload.filename is None:
            raise bad_request("file is required (a multipart part named 'file' with a filename)", param="file")
        if not upload.data.strip():
            raise bad_request("the file is empty", param="file")
        try:
            upload.data.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("the file must be UTF-8 JSONL text", param="file") from None
        return await asyncio.to_thread(store.create_file, purpose_text, upload.filename[:255] or "upload.jsonl",
                                       upload.data)

    @v1.get("/files")
    async def list_files(request: Request) -> dict:
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        limit = int_param(query.get("limit"), "limit", 10_000, 1, 10_000)
        files, has_more = await asyncio.to_thread(store.list_files, query.get("purpose"), limit,
                                                  query.get("after"), order)
        return page(files, has_more)

    @v1.get("/files/{file_id}")
    async def get_file(file_id: str) -> dict:
        file = await asyncio.to_thread(store.get_file, file_id)
        if file is None:
            raise file_not_found(file_id)
        return file

    @v1.get("/files/{file_id}/content")
    async def get_file_content(file_id: str) -> Response:
        content = await asyncio.to_thread(store.file_content, file_id)
        if content is None:
            raise file_not_found(file_id)
        return Response(content, media_type="application/octet-stream")

    @v1.delete("/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        if not await asyncio.to_thread(store.delete_file, file_id):
            raise file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def file_not_found(file_id: str, param: str = "file_id"):
    return not_found(f"no file with id {file_id!r}", param=param, code="file_not_found")
