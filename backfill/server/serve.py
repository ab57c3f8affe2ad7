"""Run the server: `python -m backfill.server [options]`, or `backfill serve` through run_server().

The database is opened first and the port bound next, so a bad --db or a taken port fails fast
with a one-line message (exit 2); while the model loads the port answers /health 200 and /ready
503 (server/health.py), and a bad --model exits 2 the same way. SIGTERM / SIGINT drain
gracefully: new requests get 503, in-flight online requests and batch lines may finish within
--drain-timeout-s, every finished batch line is already committed, and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import Callable

import uvicorn

from backfill.errors import BackfillError
from backfill.server.config import ServerConfig, add_serve_arguments, config_from_args

log = logging.getLogger("backfill.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backfill.server",
                                     description="OpenAI-compatible co-serving server (online + Batch API)")
    add_serve_arguments(parser)
    return parser


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the process exit status (0 after a graceful drain)."""
    try:
        config = config_from_args(args)
        return serve(config)
    except BackfillError as exc:
        print(f"backfill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl+C while the model loads, before uvicorn handles signals
        return 130


def serve(config: ServerConfig) -> int:
    from backfill.server.http_timeouts import header_timeout_protocol, resolve_event_loop
    from backfill.server.health import StartupResponder, bind_listener
    from backfill.server.logs import configure_logging
    from backfill.server.store import Store

    configure_logging(config.log_level, config.log_format)
    loop = resolve_event_loop(config.event_loop)   # a missing uvloop fails before the model loads
    http = header_timeout_protocol(config.header_timeout_s, config.http_parser)
    store = Store(config.db_path, fresh=config.fresh_db)
    # Bound before the model loads: /health answers (and /ready says 503) while it does (health.py).
    listener = bind_listener(config.host, config.port)
    starting = StartupResponder(listener).start()
    try:
        from backfill.server.app import create_app
        from backfill.serving.build import build_engine, build_tiny_engine

        engine = build_tiny_engine(config.serving) if config.tiny else build_engine(config.serving)
        app = create_app(engine, config, store)
        log.info("serving %s on http://%s:%d (database %s; %s, %s loop)", config.served_model_name or engine.model_name,
                 config.host, config.port, config.db_path, http.__name__, loop)
        uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                        timeout_graceful_shutdown=config.drain_timeout_s, lifespan="on",
                                        access_log=False, http=http, loop=loop,
                                        log_config=None)   # configure_logging's handler formats uvicorn's lines too
        server = DrainingServer(uvicorn_config, on_exit=app.state.backfill.begin_drain)
        starting.stop()   # the app takes the socket over; connections meanwhile wait in its backlog
        try:
            server.run(sockets=[listener])
        except SystemExit as exc:   # uvicorn exits 3 when it cannot start
            return exc.code if isinstance(exc.code, int) else 1
        return 0 if server.started else 1
    finally:
        starting.stop()
        listener.close()
        store.close()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler also starts our drain, and which exits 0 afterwards
    (uvicorn re-raises the caught signal once it has shut down, which would exit 143)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True   # a second Ctrl+C stops waiting for the drain
        else:
            self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    return run_server(build_parser().parse_args(argv))
