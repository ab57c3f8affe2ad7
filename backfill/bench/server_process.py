"""`backfill serve` in a child process, for benchmarks that measure it over HTTP.

The server binds a free port on 127.0.0.1, is used only once /ready answers 200, and is always
stopped on the way out: SIGTERM first (its graceful drain), SIGKILL when the drain takes too long.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from backfill.errors import BackfillError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BackfillError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            response = httpx.get(f"{url}/ready", timeout=2.0)
            if response.status_code == 404:   # a server from before /ready (an older checkout)
                response = httpx.get(f"{url}/health", timeout=2.0)
            if response.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BackfillError(f"server at {url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, drain_timeout_s: float = 60.0) -> None:
    """SIGTERM (the graceful drain), then SIGKILL; to its whole process group when the server was
    started in a session of its own (start_new_session), so nothing it started outlives it."""
    if proc.poll() is not None:
        return
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=drain_timeout_s)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:   # it ended meanwhile
        pass


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while the block runs, so a benchmark
    stopped by `kill` or a timeout stops the processes it started (its `finally` blocks run) instead
    of leaving them behind. Elsewhere than in the main thread, nothing changes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def served(server_args: list[str], health_timeout_s: float = 180.0) -> Iterator[str]:
    """Run `python -m backfill.server` with server_args (not --host, --port or --db: they are
    chosen here, the database in a temporary folder) and yield its base URL while it runs."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "backfill.server", "--host", "127.0.0.1", "--port", str(port),
               "--db", str(Path(tmp) / "server.db"), *server_args]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(url, proc, health_timeout_s)
            yield url
        finally:
            stop(proc)
