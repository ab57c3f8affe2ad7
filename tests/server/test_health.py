"""Liveness and readiness of a real server process: /ready 503 while it starts, 200 once it can
serve; /health 200 whenever it answers at all; a taken port fails fast."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from backfill.errors import ServerConfigError
from backfill.server.health import StartupResponder, bind_listener
from server_helpers import ServerProcess, free_port


def probe(client: httpx.Client, path: str) -> int | None:
    try:
        return client.get(path).status_code
    except httpx.TransportError:   # not bound yet
        return None


def test_ready_is_503_until_the_server_can_serve_and_health_200_throughout(tmp_path):
    server = ServerProcess(tmp_path / "s.db")
    ready_seen: list[int] = []
    health_seen: list[int] = []
    try:
        with httpx.Client(base_url=server.url, timeout=2.0) as client:
            deadline = time.monotonic() + 180
            while not ready_seen or ready_seen[-1] != 200:
                assert time.monotonic() < deadline, f"never ready: {ready_seen[-5:]}\n{server.log()}"
                assert server.proc.poll() is None, server.log()
                health, ready = probe(client, "/health"), probe(client, "/ready")
                if health is not None:
                    health_seen.append(health)
                if ready is not None:
                    ready_seen.append(ready)
                time.sleep(0.01)
            # Starting: alive, not ready; refused work says when to come back.
            assert ready_seen[0] == 503, ready_seen[:5]
            # The app has taken the socket over: it serves, and stays ready and alive.
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            for _ in range(5):
                assert client.get("/ready").status_code == 200 and client.get("/health").status_code == 200
        assert set(health_seen) == {200}, health_seen
        assert set(ready_seen) == {503, 200}
        # Once ready, never back to 503 (the start-up answers stop before the app answers).
        assert ready_seen[ready_seen.index(200):] == [200] * (len(ready_seen) - ready_seen.index(200))
    finally:
        server.stop()


def test_startup_responder_answers_until_stopped_then_the_socket_keeps_listening():
    sock = bind_listener("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        responder = StartupResponder(sock, phase="profiling").start()
        assert httpx.get(f"{url}/health").json() == {"status": "alive", "phase": "profiling"}
        assert httpx.get(f"{url}/ready").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "service_unavailable"
        responder.stop()
        # Still listening: a client connecting now waits in the backlog instead of being refused.
        with socket.create_connection(sock.getsockname()[:2], timeout=2):
            pass
    finally:
        sock.close()


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServerConfigError, match="address already in use"):
            bind_listener("127.0.0.1", taken.getsockname()[1])


def test_the_port_is_free_again_after_a_bad_model(tmp_path):
    import subprocess
    import sys

    from server_helpers import REPO_ROOT

    port = free_port()
    done = subprocess.run([sys.executable, "-m", "backfill.server", "--port", str(port), "--model",
                           str(tmp_path / "missing.gguf"), "--db", str(tmp_path / "x.db")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr
    bind_listener("127.0.0.1", port).close()   # released: nothing left bound
