"""SIGTERM to a real `serve` process: the drain keeps the listener (/health 200, /ready 503
"draining", new requests 503 with Retry-After), in-flight requests run until the deadline and
those cut by it end as the API says (a stream's error chunk and [DONE], a JSON 503), and the
process exits 0 within --drain-timeout-s. The same as PID 1 of a new PID namespace (as in a
container without an init), where the kernel drops signals the process has no handler for,
during serving and during the model load."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from server_helpers import ServerProcess, assert_error

from backfill.paths import cache_root

DRAIN_TIMEOUT_S = 3.0
# The process's own exit after the drain (interpreter teardown) may take a moment past the deadline.
EXIT_SLACK_S = 1.5
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0, "n": 2}


def can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                          timeout=10).returncode == 0


PID1 = ("unshare", "--pid", "--fork", "--mount-proc")
modes = pytest.mark.parametrize("prefix", [(), pytest.param(PID1, marks=pytest.mark.skipif(
    not can_unshare(), reason="needs root and unshare to make a PID namespace"))], ids=["process", "pid1"])


@pytest.fixture
def started(tmp_path):
    servers: list[ServerProcess] = []

    def start(*extra: str, prefix: tuple[str, ...] = (), wait: bool = True, **kwargs) -> ServerProcess:
        server = ServerProcess(tmp_path / f"drain-{len(servers)}.db", None, *extra, prefix=prefix, **kwargs)
        servers.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        if server.proc.poll() is None:
            os.kill(server.server_pid(), signal.SIGKILL)
        server.stop()


class Stream(threading.Thread):
    """One streamed request, every SSE data line kept."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines: list[str] = []
        self.status: int | None = None

    def run(self) -> None:
        with httpx.stream("POST", self.url, json={**self.body, "stream": True}, timeout=60) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])


class Unary(threading.Thread):
    """One non-streamed request."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url, json=self.body, timeout=60)


def wait_for_text(streams: list[Stream], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(len(s.lines) >= 2 for s in streams):   # every stream has produced text
        assert time.monotonic() < deadline, "the streams did not start"
        assert all(s.status in (None, 200) for s in streams), [s.lines for s in streams]
        time.sleep(0.01)


def assert_refused_while_draining(response: httpx.Response) -> None:
    assert_error(response, 503, code="service_unavailable")
    assert int(response.headers["retry-after"]) >= 1


# The real model, eager float32 and fcfs (no compile, no latency profile to measure): its 480-token
# requests take seconds on any CPU, so some certainly outlast the drain; the tiny model's could
# all finish within it on a quiet machine.
REAL_MODEL = ("--dtype", "float32", "--no-compile-decode", "--policy", "fcfs", "--kv-cache-gb", "0.25",
              "--max-model-len", "1024")


def drain_under_load(start, prefix: tuple[str, ...]) -> None:
    server = start("--drain-timeout-s", str(DRAIN_TIMEOUT_S), *REAL_MODEL, prefix=prefix, tiny=False)
    chat, text = f"{server.url}/v1/chat/completions", f"{server.url}/v1/completions"
    keep_alive = httpx.Client(timeout=10)   # a connection opened before the signal, reused during the drain
    assert keep_alive.get(f"{server.url}/health").status_code == 200
    streams = [Stream(chat, {"messages": [{"role": "user", "content": "drain"}], **LONG}),
               Stream(text, {"prompt": "drain me", **LONG}), Stream(text, {"prompt": "drain me too", **LONG})]
    unary = [Unary(chat, {"messages": [{"role": "user", "content": "drain"}], **LONG}),
             Unary(text, {"prompt": "drain", **LONG})]
    for worker in streams + unary:
        worker.start()
    wait_for_text(streams)

    signalled = time.monotonic()
    os.kill(server.server_pid(), signal.SIGTERM)
    time.sleep(0.2)
    health = httpx.get(f"{server.url}/health", timeout=5)
    ready = httpx.get(f"{server.url}/ready", timeout=5)
    refused = httpx.post(text, json={"prompt": "new", "max_tokens": 2}, timeout=5)
    refused_on_open_connection = keep_alive.post(chat, json={"messages": [{"role": "user", "content": "x"}]})
    assert time.monotonic() - signalled < DRAIN_TIMEOUT_S - 1, "the probes must land within the drain"
    assert health.status_code == 200, health.text
    assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
    assert_refused_while_draining(refused)
    assert_refused_while_draining(refused_on_open_connection)

    code = server.proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
    exited_s = time.monotonic() - signalled
    keep_alive.close()
    for worker in streams + unary:
        worker.join(timeout=10)
    assert code == 0, server.log()
    assert exited_s <= DRAIN_TIMEOUT_S + EXIT_SLACK_S, f"exited {exited_s:.1f} s after SIGTERM"
    assert "Traceback" not in server.log() and "CancelledError" not in server.log(), server.log()

    cut = 0
    for stream in streams:
        assert stream.status == 200 and stream.lines[-1] == "[DONE]", stream.lines[-3:]
        last = json.loads(stream.lines[-2])
        if "error" in last:   # cut by the deadline: the error chunk the API sends mid-stream
            assert last["error"]["code"] == "service_unavailable", last
            cut += 1
        else:
            assert all(choice["finish_reason"] for choice in last["choices"]), last
    for request in unary:
        if request.response.status_code == 503:
            assert_error(request.response, 503, code="service_unavailable")
            cut += 1
        else:
            assert request.response.status_code == 200, request.response.text
    assert cut >= 1, "480-token requests on the real model outlast a 3 s drain; none was cut"


@pytest.mark.slow
@modes
def test_sigterm_under_streamed_and_unary_load_drains_and_exits_0(started, prefix):
    drain_under_load(started, prefix)


@modes
def test_sigterm_during_the_model_load_exits_0(started, prefix):
    server = started(prefix=prefix, wait=False)
    deadline = time.monotonic() + 60
    while True:   # the start-up responder answers while the model loads
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        try:
            ready = httpx.get(f"{server.url}/ready", timeout=1)
            if ready.status_code == 503 and ready.json().get("status") == "starting":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    signalled = time.monotonic()
    os.kill(server.server_pid(), signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert time.monotonic() - signalled < 5
    assert "stopped by SIGTERM while starting" in server.log() or "SIGTERM: draining" in server.log()
    with pytest.raises(httpx.ConnectError):   # the port is closed again
        httpx.get(f"{server.url}/health", timeout=1)


@pytest.mark.slow
def test_pre_stop_delay_keeps_taking_requests_while_ready_says_draining(started):
    server = started("--drain-timeout-s", "6", "--drain-pre-stop-s", "2", "--log-level", "info", *REAL_MODEL,
                     tiny=False)
    text = f"{server.url}/v1/completions"
    busy = Stream(text, {"prompt": "busy", **LONG})   # keeps the drain going past the pre-stop delay
    busy.start()
    wait_for_text([busy])
    signalled = time.monotonic()
    os.kill(server.server_pid(), signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/ready", timeout=5).json()["status"] == "draining"
    during = httpx.post(text, json={"prompt": "still here", "max_tokens": 2}, timeout=5)
    assert time.monotonic() - signalled < 2, "the request must land within the pre-stop delay"
    assert during.status_code == 200, during.text
    while time.monotonic() - signalled < 2.2:
        time.sleep(0.05)
    assert_refused_while_draining(httpx.post(text, json={"prompt": "late", "max_tokens": 2}, timeout=5))
    assert server.proc.wait(timeout=30) == 0, server.log()
    busy.join(timeout=10)
    assert busy.lines[-1] == "[DONE]"
    assert "SIGTERM: draining" in server.log()


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare to make a PID namespace")
def test_sigterm_as_pid1_while_measuring_the_latency_profile(started, tmp_path):
    """The real model with no cached profile: the start measures one for minutes; SIGTERM then
    ends it at once (the torch thread cannot be interrupted, so the process leaves without it)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    # What earlier tests cached (the unpacked weights, the kernel choice) is linked in, so the
    # start reaches the measurement in seconds; the latency profile alone is left out.
    for entry in cache_root().glob("*"):
        if entry.name != "profiles" and entry.is_dir():
            (cache / entry.name).symlink_to(entry, target_is_directory=True)
    server = started("--log-level", "info", prefix=PID1, tiny=False, wait=False,
                     env={"BACKFILL_CACHE_DIR": str(cache)})
    deadline = time.monotonic() + 120
    while "measuring one" not in server.log():
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        time.sleep(0.05)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    os.kill(server.server_pid(), signal.SIGTERM)
    signalled = time.monotonic()
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert time.monotonic() - signalled < 5
    assert "stopped by SIGTERM while starting" in server.log()
    assert not any((tmp_path / "cache" / "profiles").glob("*")), "no half-measured profile is saved"
