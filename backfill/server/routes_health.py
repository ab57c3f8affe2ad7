"""GET /health and GET /metrics: what a load balancer and Prometheus read (no API key)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from backfill.server.state import ServerState


def add_health_routes(app: FastAPI, state: ServerState) -> None:
    engine, store, worker, metrics = state.engine, state.store, state.worker, state.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        store_health = await asyncio.to_thread(store.health)
        store_health["unwritable_batch_lines"] = len(worker.unwritable)
        ok = engine.running and not state.draining and store_health["status"] != "error"
        # Ready, as vLLM reports it, only after warm-up: requests are served meanwhile, but the
        # background compile shares the cores with every step until it ends.
        warming = ok and engine.warming_up
        status = "warming_up" if warming else "ok" if ok else "unavailable"
        return JSONResponse({"status": status, "engine": "running" if engine.running else "stopped",
                             "draining": state.draining, "store": store_health},
                            status_code=200 if ok and not warming else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type="text/plain; version=0.0.4; charset=utf-8")
