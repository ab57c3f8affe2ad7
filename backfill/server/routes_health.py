"""GET /health, GET /ready and GET /metrics: what an orchestrator, a load balancer and Prometheus
read (no API key). Liveness and readiness are told apart (server/health.py says how)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from backfill.server.health import readiness
from backfill.server.state import ServerState


def add_health_routes(app: FastAPI, state: ServerState) -> None:
    metrics = state.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        # Alive: nothing here may block on the store or the engine (a liveness probe must not
        # restart a process that is only busy).
        return JSONResponse({"status": "alive", "uptime_s": int(time.time()) - state.started_at})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, body = await asyncio.to_thread(readiness, state)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type="text/plain; version=0.0.4; charset=utf-8")
