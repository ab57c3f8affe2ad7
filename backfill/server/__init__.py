"""OpenAI-compatible HTTP server: streamed online completions, the Batch API for offline work,
durable job state in SQLite, Prometheus metrics.

Entry points (imported lazily, so `backfill serve --help` does not load torch or FastAPI):
    add_serve_arguments(parser)   # the options of `backfill serve`
    run_server(args) -> int       # serve until SIGTERM; exit status
    create_app(engine, ServerConfig(...), Store(path)) -> FastAPI
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "add_serve_arguments": "backfill.server.config",
    "config_from_args": "backfill.server.config",
    "ServerConfig": "backfill.server.config",
    "run_server": "backfill.server.serve",
    "serve": "backfill.server.serve",
    "create_app": "backfill.server.app",
    "Store": "backfill.server.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'backfill.server' has no attribute {name!r}")
