"""The OpenAI-compatible HTTP app: online completions (streamed), the Batch API, health and metrics.

    app = create_app(engine, ServerConfig(...), Store(path))   # the app starts/stops the engine

Online requests run as RequestClass.ONLINE unless they ask for service_tier "flex"; batch
lines always run as OFFLINE. A client that disconnects cancels its request at once (the engine
frees its KV blocks), whether it was streaming or not.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from backfill.server.adapters import add_adapter_routes
from backfill.server.admission import QueuedRequest, TtftAdmission, retry_after_header
from backfill.server.access_log import AccessLogMiddleware
from backfill.server.batches import BatchWorker
from backfill.server.completions import CompletionService, Generation, Kind, Prepared
from backfill.server.config import ServerConfig
from backfill.server.dashboard import add_dashboard_routes
from backfill.server.errors import APIError, bad_request, install_error_handlers, not_found
from backfill.server.fine_tuning import FINE_TUNE_PURPOSE, FineTuningWorker, add_fine_tuning_routes
from backfill.server.fine_tuning_store import FineTuningStore
from backfill.server.health import add_health_routes
from backfill.server.metrics import CLASSES, ServerMetrics
from backfill.server.multipart import parse_multipart
from backfill.server.schemas import BatchCreateBody, parse_json, validate_body
from backfill.server.sse import DONE
from backfill.server.store import Store
from backfill.server.tracing import install_tracing
from backfill.types import RequestClass
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.config import ServingConfig

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    store: Store
    service: CompletionService
    metrics: ServerMetrics
    worker: BatchWorker
    fine_tuning: FineTuningWorker
    started_at: int = field(default_factory=lambda: int(time.time()))
    in_flight: dict[str, int] = field(default_factory=lambda: {cls: 0 for cls in CLASSES})
    draining: bool = False
    drain_deadline_s: float | None = None
    # Called with (class, requests in flight) on every change: a node's model server reports its
    # online lifecycle to the node runtime's gate from here (backfill/node/model_server.py).
    on_in_flight_change: Callable[[str, int], None] | None = None
    admission: TtftAdmission | None = None
    # Admitted online requests and the TTFT predicted for each when it was admitted.
    online: dict[Generation, float] = field(default_factory=dict)

    def begin_drain(self) -> None:
        """Stop taking work (SIGTERM): new requests get 503, the batch worker starts no new lines."""
        if not self.draining:
            self.draining = True
            self.drain_deadline_s = time.monotonic() + self.config.drain_timeout_s
            self.worker.stop_accepting()

    def admit(self, prepared: Prepared) -> float:
        """Take the request or raise 503 / 429; returns its predicted TTFT (ms; 0 when not predicted)."""
        request_class = prepared.request.request_class.value
        if self.draining:
            raise APIError(503, "the server is shutting down", code="service_unavailable")
        if self.in_flight[request_class] >= self.config.max_online_queue:
            self.metrics.rejected.labels(request_class).inc()
            raise APIError(429, f"too many {request_class} requests in flight "
                                f"({self.config.max_online_queue}); retry later", code="queue_full")
        predicted_ms = 0.0
        if self.admission is not None and prepared.request.request_class is RequestClass.ONLINE:
            num_prompt = len(prepared.request.prompt_token_ids) * len(prepared.requests)
            now = time.monotonic()
            decision = self.admission.decide(num_prompt, (queued_view(g, predicted, now)
                                                          for g, predicted in self.online.items()))
            if not decision.admit:
                self.metrics.rejected.labels(request_class).inc()
                raise APIError(429, f"the server is at capacity: this request's time to first token is predicted "
                                    f"at {decision.predicted_ttft_ms:.0f} ms, over the {self.admission.ttft_slo_ms:g} ms "
                                    f"SLO; retry after the Retry-After header's seconds", code="slo_overload",
                               headers=retry_after_header(decision.retry_after_ms))
            predicted_ms = decision.predicted_ttft_ms
        self.in_flight[request_class] += 1
        if self.on_in_flight_change is not None:
            self.on_in_flight_change(request_class, self.in_flight[request_class])
        return predicted_ms

    def track(self, generation: Generation, predicted_ms: float) -> None:
        if generation.request.request_class is RequestClass.ONLINE:
            self.online[generation] = predicted_ms

    def release(self, request_class: str, generation: Generation | None = None) -> None:
        self.in_flight[request_class] -= 1
        if self.on_in_flight_change is not None:
            self.on_in_flight_change(request_class, self.in_flight[request_class])
        predicted_ms = self.online.pop(generation, None) if generation is not None else None
        if predicted_ms and self.admission is not None and generation.first_token_s is not None:
            self.admission.observe(predicted_ms, (generation.first_token_s - generation.request.arrival_time) * 1e3)


def queued_view(generation: Generation, predicted_ttft_ms: float = 0.0,
                now_s: float | None = None) -> QueuedRequest:
    now_s = time.monotonic() if now_s is None else now_s
    unfinished = [i for i, reason in enumerate(generation.finish_reasons) if reason is None]
    max_tokens = generation.request.sampling.max_tokens
    return QueuedRequest(len(generation.request.prompt_token_ids) * len(generation.requests),
                         generation.first_token_s is not None, len(unfinished),
                         min((max_tokens - generation.output_tokens[i] for i in unfinished), default=0),
                         (now_s - generation.request.arrival_time) * 1e3, predicted_ttft_ms)


def make_admission(engine: AsyncEngine, config: ServerConfig) -> TtftAdmission | None:
    """Admission by predicted TTFT (and decode step time) where the policy has a latency profile (coserve);
    None: queue length only."""
    latency = engine.policy.latency
    if latency is None or math.isinf(config.admission_ttft_share):
        return None
    serving = config.serving or ServingConfig()
    limits = serving.limits or serving.coserve.limits
    correction_for = engine.policy.correction_for

    def estimate_ms(shape, _raw=latency.estimate_ms):  # the profile as the policy corrects it from measured steps
        return correction_for(shape.num_tokens) * _raw(shape)

    return TtftAdmission(estimate_ms, serving.coserve.slo.ttft_ms, limits.max_batch_tokens,
                         config.admission_ttft_share, serving.coserve.slo.tpot_ms, limits.max_batch_seqs)


def create_app(engine: AsyncEngine, config: ServerConfig, store: Store) -> FastAPI:
    served_model = config.served_model_name or engine.model_name
    metrics = ServerMetrics(engine)
    service = CompletionService(engine, metrics, served_model)
    install_tracing(engine, service, config)
    worker = BatchWorker(store, service, config.max_offline_in_flight)
    metrics.batch_lines_in_flight = lambda: worker.in_flight
    metrics.backlog = store.backlog
    fine_tuning = FineTuningWorker(FineTuningStore(store), store, engine, served_model,
                                   config.db_path.with_name(config.db_path.name + ".fine_tuning"))
    state = ServerState(engine, config, store, service, metrics, worker, fine_tuning,
                        admission=make_admission(engine, config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        worker.start()
        fine_tuning.start()
        dashboard.start()
        try:
            yield
        finally:
            await dashboard.stop()
            state.begin_drain()
            await fine_tuning.stop()
            await worker.stop(state.drain_deadline_s)
            await engine.stop()

    app = ServingApp(title="backfill", version="0.1.0", lifespan=lifespan,
                     description="OpenAI-compatible co-serving of online and offline LLM requests")
    app.state.backfill = state
    app.add_middleware(AccessLogMiddleware)
    install_error_handlers(app)

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    limit_bytes = int(config.max_body_mb * 2**20)

    add_health_routes(app, state)
    dashboard = add_dashboard_routes(app, state)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(model_id: str = served_model) -> dict:
        card = {"id": model_id, "object": "model", "created": state.started_at, "owned_by": "backfill",
                "max_model_len": engine.scheduler.max_model_len}
        if model_id != served_model:  # a LoRA adapter (a fine-tuned model) on the base model, as vLLM lists them
            card.update(root=model_id, parent=served_model)
        return card

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *(model_card(name) for name in engine.adapters.names())]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != served_model and model_id not in engine.adapters:
            raise not_found(f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_card(model_id)

    async def generate(request: Request, kind: Kind) -> Response:
        arrived = time.monotonic()
        data = parse_json(await read_body(request, limit_bytes, config.body_timeout_s))
        prepared = service.prepare(kind, data, arrival_time=arrived)
        request_class = prepared.request.request_class.value
        request.state.request_class = request_class
        predicted_ms = state.admit(prepared)
        try:
            generation = service.submit(prepared, trace_carrier=request.headers)
        except BaseException:
            state.release(request_class)
            raise
        state.track(generation, predicted_ms)
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

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "text")

    # --- files -----------------------------------------------------------------------------------

    @v1.post("/files")
    async def upload_file(request: Request) -> dict:
        body = await read_body(request, limit_bytes, config.body_timeout_s)
        parts = parse_multipart(body, request.headers.get("content-type", ""))
        purpose = parts.get("purpose")
        if purpose is None:
            raise bad_request("purpose is required", param="purpose")
        purpose_text = purpose.data.decode("utf-8", "replace").strip()
        if purpose_text not in ("batch", FINE_TUNE_PURPOSE):
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

    async def existing_file(file_id: str) -> dict:
        file = await asyncio.to_thread(store.get_file, file_id)
        if file is None:
            raise not_found(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return file

    @v1.get("/files/{file_id}")
    async def get_file(file_id: str) -> dict:
        return await existing_file(file_id)

    @v1.get("/files/{file_id}/content")
    async def get_file_content(file_id: str) -> Response:
        content = await asyncio.to_thread(store.file_content, file_id)
        if content is None:
            raise not_found(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return Response(content, media_type="application/octet-stream")

    @v1.delete("/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        if not await asyncio.to_thread(store.delete_file, file_id):
            raise not_found(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    # --- batches ---------------------------------------------------------------------------------

    @v1.post("/batches")
    async def create_batch(request: Request) -> dict:
        body = validate_body(BatchCreateBody, parse_json(await read_body(request, limit_bytes, config.body_timeout_s)))
        file = await asyncio.to_thread(store.get_file, body.input_file_id)
        if file is None:
            raise not_found(f"no file with id {body.input_file_id!r}", param="input_file_id",
                            code="file_not_found")
        if file["purpose"] != "batch":
            raise bad_request(f"file {body.input_file_id!r} has purpose {file['purpose']!r}, not 'batch'",
                              param="input_file_id")
        if state.draining:
            raise APIError(503, "the server is shutting down", code="service_unavailable")
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

    base_models = (served_model, engine.model_name)
    add_fine_tuning_routes(v1, fine_tuning.jobs, store, fine_tuning, base_models, limit_bytes, lambda: state.draining)
    add_adapter_routes(v1, engine, base_models)
    app.include_router(v1)
    return app


def page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", param=name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


async def read_body(request: Request, limit_bytes: int, timeout_s: float | None = None) -> bytes:
    """The whole body, or 413 as soon as it passes the limit (before reading it all when declared),
    or 408 (and the connection closed) when the client stalls for timeout_s between two pieces."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
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
            raise _too_large(limit_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit_bytes / 2**20:g} MiB",
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
