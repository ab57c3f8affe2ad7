"""The offload coordinator (AQUA §6): producers offer memory, consumers lease and allocate it,
producers reclaim it. A FastAPI service whose state lives in SQLite, so a restarted
coordinator knows every offer, lease and allocation it granted.

Safety rests on leases: a consumer renews its lease every few iterations and learns there
which regions to vacate; one that cannot renew moves everything to host memory. An expired
lease's allocations are freed, so a killed consumer leaks nothing, and a producer may reuse
reclaimed memory once its offer shows no bytes allocated.

Run: python -m backfill.offload.coordinator --port 8700 --db runs/offload.sqlite

The state and the bodies are in coordinator_store.py, the routes in coordinator_routes.py (one
`add_X_routes` per resource, as the server's routes_*.py); this module assembles the app.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI

from backfill.offload.coordinator_routes import (add_allocation_routes, add_health_routes, add_lease_routes,
                                                 add_offer_routes)
from backfill.offload.coordinator_store import CoordinatorStore


def create_app(db_path: str, clock=time.time) -> FastAPI:
    store = CoordinatorStore(db_path, clock)
    app = FastAPI(title="backfill offload coordinator")
    app.state.store = store
    add_health_routes(app, store)
    v1 = APIRouter(prefix="/v1")
    for add_routes in (add_offer_routes, add_lease_routes, add_allocation_routes):
        add_routes(v1, store)
    app.include_router(v1)
    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--db", default="runs/offload-coordinator.sqlite", help="SQLite file holding the state")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    uvicorn.run(create_app(args.db), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    serve(parser.parse_args())
