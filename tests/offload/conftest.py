import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CoordinatorProcess:
    """The coordinator as a real process on 127.0.0.1, restartable on the same SQLite file."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "CoordinatorProcess":
        port = free_port()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "backfill.offload.coordinator", "--port", str(port),
                                      "--db", self.db], env=env, cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("coordinator did not start")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def coordinator(tmp_path):
    coord = CoordinatorProcess(str(tmp_path / "coordinator.sqlite")).start()
    yield coord
    coord.stop()
