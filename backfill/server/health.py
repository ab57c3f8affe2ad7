"""Liveness and readiness, told apart as orchestrators probe them.

    GET /health   200 whenever the process is alive and answering (a liveness probe: restart on failure)
    GET /ready    200 once the server can serve now: the model loaded, the store checked, the
                  engine running, compiled decode's buckets built; 503 before, while draining,
                  and while the store is broken (a readiness probe: route traffic elsewhere)

`backfill serve` binds its port before it loads the model (bind_listener) and answers there with
StartupResponder until the app takes the same socket over: a probe during a long model load or
latency profiling sees the process alive (/health 200) and not yet ready (/ready 503), never a
refused connection that a liveness probe would restart it for.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from backfill.errors import ServerConfigError

if TYPE_CHECKING:
    from backfill.server.state import ServerState

LISTEN_BACKLOG = 2048   # uvicorn's default


def readiness(state: ServerState) -> tuple[bool, dict[str, Any]]:
    """Whether the server can serve now, and why not (the /ready body)."""
    store_health = state.store.health()
    store_health["unwritable_batch_lines"] = len(state.worker.unwritable)
    engine = state.engine
    ok = engine.running and not state.draining and store_health["status"] != "error"
    # Ready, as vLLM reports it, only after warm-up: requests are served meanwhile, but the
    # background compile shares the cores with every step until it ends.
    # Ready once the background compile ends and finished fine-tuning jobs' adapters (served models) load.
    warming = ok and (engine.warming_up or not state.fine_tuning.finished_adapters_loaded)
    status = "warming_up" if warming else "ok" if ok else "draining" if state.draining else "unavailable"
    return ok and not warming, {"status": status, "engine": "running" if engine.running else "stopped",
                                "draining": state.draining, "store": store_health}


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, as uvicorn would bind it (ServerConfigError if it cannot)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = (exc.strerror or str(exc)).lower()
        raise ServerConfigError(f"cannot bind {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


class QuietHTTPServer(ThreadingHTTPServer):
    """A client that gives up on an answer (a probe's timeout while the model loads) is no error."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StartupResponder:
    """Answers on the bound socket while the server starts: /health 200, everything else 503.

    stop() leaves the socket open and listening: connections arriving between stop() and the app
    taking the socket over wait in its backlog instead of being refused."""

    def __init__(self, sock: socket.socket, phase: str = "loading the model") -> None:
        self.phase = phase
        self._server = QuietHTTPServer(sock.getsockname()[:2], _startup_handler(self), bind_and_activate=False)
        self._server.socket = sock
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    def start(self) -> "StartupResponder":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="startup-responder")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None


def _startup_handler(responder: StartupResponder) -> type[BaseHTTPRequestHandler]:
    class StartupHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                status, body = 200, {"status": "alive", "phase": responder.phase}
            elif path == "/ready":
                status, body = 503, {"status": "starting", "phase": responder.phase}
            else:
                status, body = 503, {"error": {"message": f"the server is starting ({responder.phase}); "
                                               "retry when GET /ready answers 200", "type": "server_error",
                                               "param": None, "code": "service_unavailable"}}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 503:
                self.send_header("Retry-After", "1")
            # One answer per connection: the next request must reach the app once it has taken over.
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.close_connection = True

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _answer  # noqa: N815 (http.server's names)

        def log_message(self, *args: Any) -> None:
            pass

    return StartupHandler
