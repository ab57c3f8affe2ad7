"""Helpers for server tests: real apps on the tiny model, live uvicorn servers on free ports,
server subprocesses, and Batch API input. Everything started here is stopped by its owner."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import uvicorn

from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_tiny_engine

REPO_ROOT = Path(__file__).resolve().parents[2]
ERROR_KEYS = {"message", "type", "param", "code"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_app(db_path: Path, max_model_len: int = 512, **config):
    """A real app (tiny random model, real SQLite store); the app starts and stops the engine."""
    serving = ServingConfig(kv_cache_gb=0.0625, max_model_len=max_model_len)
    config.setdefault("drain_timeout_s", 2.0)
    server_config = ServerConfig(serving=serving, db=str(db_path), **config)
    return create_app(build_tiny_engine(serving), server_config, Store(db_path))


def close_app(app) -> None:
    app.state.backfill.store.close()


class LiveServer:
    """uvicorn serving an app on 127.0.0.1 in a background thread."""

    def __init__(self, app, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the live server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        close_app(self.app)

    @property
    def state(self):
        return self.app.state.backfill


@contextmanager
def live_server(tmp_path: Path, **config) -> Iterator[LiveServer]:
    with LiveServer(make_app(tmp_path / "server.db", **config)) as server:
        yield server


def sample_value(exposition: str, name: str, **labels: str) -> float:
    """The value of the one sample of a /metrics text named name whose labels include labels."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [sample.value for family in text_string_to_metric_families(exposition) for sample in family.samples
             if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in /metrics"
    return found[0]


def openai_client(url: str, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


class ServerProcess:
    """`python -m backfill.server --tiny` as a subprocess (for kill -9 and SIGTERM tests)."""

    def __init__(self, db: Path, port: int | None = None, *extra: str, prefix: tuple[str, ...] = (),
                 tiny: bool = True, env: dict[str, str] | None = None) -> None:
        """prefix: a command the server runs under (`unshare --pid --fork --mount-proc` makes it PID 1)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = db.with_name(f"server-{self.port}-{time.monotonic_ns()}.log")
        command = [*prefix, sys.executable, "-m", "backfill.server", *(("--tiny",) if tiny else ()),
                   "--port", str(self.port), "--db", str(db), "--log-level", "warning", *extra]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **(env or {}))
        self.prefixed = bool(prefix)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def server_pid(self) -> int:
        """The server's own process id: the child of the prefix's command, if any, else proc's."""
        deadline = time.monotonic() + 10
        while self.prefixed:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            if children:
                return int(children[0])
            if self.proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


FINAL_STATUSES = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, content: str = "hi", **body) -> str:
    """One batch input line for /v1/chat/completions."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def upload(client, lines: list[str]):
    return client.files.create(file=("input.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")


def wait_final(client, batch_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL_STATUSES:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.05)
