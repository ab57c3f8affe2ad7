"""Errors of the HTTP edge, always answered in OpenAI's shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Every user mistake becomes a 4xx with a message that names the offending field; a 500 is only
ever a bug in backfill (logged with its traceback, never shown to the client).
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backfill.errors import (AdapterLoadError, BackfillError, ContextLengthError, EngineStoppedError,
                             InvalidRequestError, UnknownAdapterError)

from backfill.server.store_integrity import DamagedContentError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


DEFAULT_RETRY_AFTER_S = 1


class APIError(BackfillError):
    """A request the server refuses; carries the HTTP status and OpenAI's error fields."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        if status_code in (429, 503):
            # Every 429 and 503 says when to come back (clients such as openai-python honour it,
            # reading retry-after-ms first).
            self.headers.setdefault("Retry-After", str(DEFAULT_RETRY_AFTER_S))
            self.headers.setdefault("retry-after-ms", str(1000 * int(self.headers["Retry-After"])))
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def from_backfill_error(exc: BackfillError) -> APIError:
    """The HTTP form of a typed error raised below the server (engine, tokenizer, sampling)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownAdapterError):  # unloaded between the model check and the engine's
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, AdapterLoadError):
        return APIError(400, str(exc), code="invalid_adapter")
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, DamagedContentError):   # the server's fault, said plainly: never the damaged bytes
        log.error("%s", exc)
        return APIError(500, str(exc), code="stored_content_damaged", type="server_error")
    if isinstance(exc, EngineStoppedError):
        return APIError(503, "the server is shutting down", code="service_unavailable")
    log.error("unexpected %s at the HTTP edge: %s", type(exc).__name__, exc)
    return APIError(500, "internal server error", code="internal_error", type="server_error")


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_backfill_error(request: Request, exc: BackfillError) -> JSONResponse:
        api = from_backfill_error(exc)
        headers = dict(api.headers)
        if api.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return error_response(api, headers or None)

    async def on_store_error(request: Request, exc: sqlite3.Error) -> JSONResponse:
        # A damaged or unwritable database is the server's problem, said plainly (the connection
        # stays usable) rather than a bare 500.
        log.error("database error on %s %s: %s", request.method, request.url.path, exc)
        api = APIError(503, f"the server's database failed: {exc}", code="store_error",
                       headers={"Retry-After": "30"})
        return error_response(api, api.headers)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message), dict(exc.headers or {}) or None)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 (path and query parameters) would leak pydantic's raw output.
        return error_response(validation_error(exc.errors()))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(BackfillError, on_backfill_error)
    app.add_exception_handler(sqlite3.Error, on_store_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)


def validation_error(errors: list[dict]) -> APIError:
    """One readable 400 from pydantic's error list: the first problem, named by its field path."""
    if not errors:
        return bad_request("invalid request")
    unknown = next((e for e in errors if e.get("type") == "extra_forbidden"), None)
    if unknown is not None:
        # An unknown key is the most specific problem, even inside one form of a union field.
        param = field_path(part for part in unknown["loc"] if not _is_type_tag(str(part)))
        return bad_request(f"{param}: unknown field; remove it (the fields this endpoint takes are in the "
                           f"OpenAPI document, /openapi.json)", param=param)
    first = errors[0]
    raw = [part for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    tag_at = next((i for i, part in enumerate(raw) if _is_type_tag(str(part))), None)
    if tag_at is not None:
        # A union field: say which forms it accepts instead of one branch's complaint.
        prefix = raw[:tag_at]
        forms = []
        for error in errors:
            loc = [part for part in error.get("loc", ()) if part not in ("body", "query", "path")]
            if loc[:tag_at] == prefix and len(loc) > tag_at and loc[tag_at] not in forms:
                forms.append(str(loc[tag_at]))
        param = field_path(prefix) or None
        text = f"invalid value; expected {' or '.join(forms)}"
        return bad_request(f"{param}: {text}" if param else text, param=param)
    param = field_path(raw) or None
    message = first.get("msg", "invalid value")
    text = f"{param}: {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(text, param=param)


def field_path(parts: Iterable[str | int]) -> str:
    """A field's path as a client writes it: messages[0].content, stream_options.include_usage."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _is_type_tag(part: str) -> bool:
    """A union's branch in a pydantic location: a type (str, list[TextPart]) or a model's class name
    (NamedToolChoice); field names are lower case."""
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part or part[:1].isupper()
