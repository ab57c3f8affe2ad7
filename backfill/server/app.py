"""The OpenAI-compatible HTTP app: online completions (streamed), the Batch API, health and metrics.

    app = create_app(engine, ServerConfig(...), Store(path))   # the app starts/stops the engine

Online requests run as RequestClass.ONLINE unless they ask for service_tier "flex"; batch
lines always run as OFFLINE. A client that disconnects cancels its request at once (the engine
frees its KV blocks), whether it was streaming or not. The routes live in one module per API
(routes_*.py), the helpers they share in http_helpers.py, the state they share in state.py.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request

from backfill.server.access_log import AccessLogMiddleware
from backfill.server.batches import BatchWorker
from backfill.server.browser_guard import BrowserGuard, BrowserGuardMiddleware
from backfill.server.completions import CompletionService
from backfill.server.config import ServerConfig
from backfill.server.dashboard import add_dashboard_routes
from backfill.server.errors import APIError, install_error_handlers
from backfill.server.fine_tuning import FineTuningWorker
from backfill.server.fine_tuning_store import FineTuningStore
from backfill.server.http_helpers import ServingApp
from backfill.server.metrics import ServerMetrics
from backfill.server.routes_adapters import add_adapter_routes
from backfill.server.routes_batches import add_batch_routes
from backfill.server.routes_completions import add_completion_routes
from backfill.server.routes_files import add_file_routes
from backfill.server.routes_fine_tuning import add_fine_tuning_routes
from backfill.server.routes_health import add_health_routes
from backfill.server.routes_models import add_model_routes
from backfill.server.state import ServerState, make_admission
from backfill.server.store import Store
from backfill.server.tracing import install_tracing
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.config import ServingConfig


def create_app(engine: AsyncEngine, config: ServerConfig, store: Store) -> FastAPI:
    served_model = config.served_model_name or engine.model_name
    slo = (config.serving or ServingConfig()).coserve.slo
    metrics = ServerMetrics(engine, served_model, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3)
    service = CompletionService(engine, metrics, served_model)
    install_tracing(engine, service, config)
    worker = BatchWorker(store, service, config.max_offline_in_flight)
    metrics.batch_lines_in_flight = lambda: worker.in_flight
    metrics.backlog = store.backlog
    metrics.damaged_reads = lambda: store.damaged_reads
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
    app.add_middleware(BrowserGuardMiddleware,
                       guard=BrowserGuard(config.host, config.allowed_hosts, config.allowed_origins))
    app.add_middleware(AccessLogMiddleware, metrics=metrics)   # outermost: refused requests are logged too
    install_error_handlers(app)

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def refuse_while_draining() -> None:
        state.check_not_draining()   # 503 + Retry-After once SIGTERM's pre-stop delay has passed

    add_health_routes(app, state)
    dashboard = add_dashboard_routes(app, state)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(refuse_while_draining), Depends(authorize)])
    for add_routes in (add_model_routes, add_completion_routes, add_file_routes, add_batch_routes,
                       add_fine_tuning_routes, add_adapter_routes):
        add_routes(v1, state)
    app.include_router(v1)
    return app
