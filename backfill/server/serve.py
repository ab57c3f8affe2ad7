"""Run the server: `python -m backfill.server [options]`, or `backfill serve` through run_server().

The database is opened first and the port bound next, so a bad --db or a taken port fails fast
with a one-line message (exit 2); while the model loads the port answers /health 200 and /ready
503 (server/health.py), and a bad --model exits 2 the same way.

SIGTERM drains and keeps the listener (docs/operations.md, "Shutdown"): /health stays 200 and
/ready says 503 "draining" at once; after --drain-pre-stop-s new requests get 503 with
Retry-After; in-flight requests run until just before --drain-timeout-s, and those still running
then end as the API says (a stream's error chunk and [DONE], a JSON 503); the process exits 0
within the timeout. Every finished batch line is already committed. SIGTERM and SIGINT are
handled from the start (model load and latency profiling included), so that they work when the
process is PID 1 of a container, where the kernel drops a signal the process has no handler for.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
from types import FrameType
from typing import NoReturn, Protocol

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
    stop_start_up_on_signals()   # first: a signal during the model load or profiling is not lost
    try:
        config = config_from_args(args)
        code = serve(config)
    except BackfillError as exc:
        print(f"backfill: error: {exc}", file=sys.stderr)
        return 2
    except StartUpInterrupted as exc:
        # The model load or profiling runs on the torch thread, which nothing can interrupt and
        # which the interpreter would wait for at exit (minutes while profiling); the listener and
        # the database are closed already (serve's finally).
        log.warning("stopped by %s while starting (nothing was served; nothing to drain)", exc.signal_name)
        leave(130 if exc.signal_name == "SIGINT" else 0)
    # Served and drained: the exit must fit in --drain-timeout-s, and the interpreter's own
    # teardown (torch's thread pools, the model's tensors) takes seconds on a busy machine.
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit now: the exit handlers (log and trace exporters flush) run, the interpreter's teardown does not."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StartUpInterrupted(BaseException):
    """SIGTERM or SIGINT arrived before uvicorn took over the signals (model load, profiling).
    A BaseException, like KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def _interrupt_start_up(sig: int, frame: FrameType | None) -> None:
    raise StartUpInterrupted(signal.Signals(sig).name)


def stop_start_up_on_signals() -> None:
    """SIGTERM / SIGINT end the start-up from here on (uvicorn installs its own while serving).
    Without a handler, PID 1 of a PID namespace (a container without an init) never sees
    SIGTERM: the kernel drops signals that PID 1 has not asked for."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt_start_up)


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
        # The drain happens before uvicorn's shutdown (DrainingServer); by then only the answers
        # already being written remain.
        uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                        timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on",
                                        access_log=False, http=http, loop=loop,
                                        log_config=None)   # configure_logging's handler formats uvicorn's lines too
        server = DrainingServer(uvicorn_config, app.state.backfill)
        starting.stop()   # the app takes the socket over; connections meanwhile wait in its backlog
        try:
            server.run(sockets=[listener])
        except SystemExit as exc:   # uvicorn exits 3 when it cannot start
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            # uvicorn restored the start-up handlers; a late signal must not interrupt the cleanup.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        return 0 if server.started else 1
    finally:
        starting.stop()
        listener.close()
        store.close()


SHUTDOWN_GRACE_S = 2.0   # after the drain: for answers still being written when the listener closes


class Drain(Protocol):
    """What DrainingServer drains (ServerState)."""

    def begin_drain(self) -> None: ...

    def drain_finished(self) -> bool: ...


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains before it shuts down, listener open.

    uvicorn's own shutdown closes the listener first (new connections are refused, /health
    included) and then cuts whatever runs past timeout_graceful_shutdown mid-response. Here the
    first SIGTERM/SIGINT starts the drain (drain.begin_drain) and the main loop goes on serving
    until drain.drain_finished() says so; only then does uvicorn's shutdown run. The process exits
    0 afterwards (uvicorn would re-raise the caught signal, exiting 143)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining and sig == signal.SIGINT:
            self.should_exit = self.force_exit = True   # a second Ctrl+C stops waiting for the drain
            return
        if not self.draining:
            self.draining = True
            log.warning("%s: draining (new requests refused after --drain-pre-stop-s; exit within "
                        "--drain-timeout-s)", signal.Signals(sig).name)
        self.drain.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.draining and self.drain.drain_finished()


def main(argv: list[str] | None = None) -> int:
    return run_server(build_parser().parse_args(argv))
