"""The node a user runs (`backfill serve --config node.toml`) as a service: /health from the start,
/ready once every model is, and the live page of every model with the node's gate and memory."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from backfill.cluster.node_actor import free_port
from backfill.node.config import ModelEntry, NodeConfig, NodeSettings
from backfill.node.host import Node

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def started():
    """A node of two tiny models, its probes watched from another thread while it starts (on this
    thread: its model processes die with the thread that started them, PR_SET_PDEATHSIG)."""
    config = NodeConfig(NodeSettings(metrics_port=0, num_handles=32, window_s=30.0),
                        (ModelEntry(name="a", model="tiny", port=free_port(), policy="coserve"),
                         ModelEntry(name="b", model="tiny", port=free_port(), policy="priority")))
    node = Node(config)
    probes: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while node._metrics_server is None and not done.is_set():
            time.sleep(0.01)
        with httpx.Client(timeout=5) as client:
            while not done.is_set() and (not probes or probes[-1][1] != 200):
                try:
                    url = f"http://127.0.0.1:{node.metrics_port}"
                    probes.append((client.get(url + "/health").status_code, client.get(url + "/ready").status_code))
                except httpx.HTTPError:
                    return
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        node.start(timeout_s=240)
        watcher.join(30)
        yield node, probes
    finally:
        done.set()
        watcher.join(30)
        node.stop()


def test_node_is_alive_from_the_start_and_ready_once_every_model_is(started):
    node, probes = started
    assert probes[0] == (200, 503), probes[:3]
    assert {health for health, _ in probes} == {200}
    ready = httpx.get(f"http://127.0.0.1:{node.metrics_port}/ready").json()
    assert all(proc.poll() is None for proc in node.processes.values())
    assert ready == {"status": "ok", "models": {"a": 200, "b": 200}}


def test_node_dashboard_shows_every_model_and_the_gate_and_memory(started):
    node, _ = started
    url = f"http://127.0.0.1:{node.metrics_port}"
    for name in ("a", "b"):
        response = httpx.post(node.url(name) + "/v1/completions", timeout=30,
                              json={"model": name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert response.status_code == 200, response.text
    data = httpx.get(f"{url}/dashboard/data", params={"window_s": 60}).json()
    assert data["kind"] == "node" and [m["name"] for m in data["models"]] == ["a", "b"]
    assert [m["policy"] for m in data["models"]] == ["coserve", "priority"]
    assert all(m["window"]["online_requests"] == 1 and m["window"]["online_tokens"] == 4 for m in data["models"])
    assert data["node"]["num_handles"] == 32 and data["node"]["gate"] == node.config.node.gate
    assert 0 <= data["node"]["free_memory_fraction"] <= 1
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and "dashboard/data" in page.text
    if CHROMIUM is None:
        pytest.skip("rendering needs a chromium binary (Debian: apt-get install chromium)")
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=8000", "--dump-dom", f"{url}/dashboard"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and 'data-loaded="true"' in done.stdout, done.stderr[-2000:]
    assert re.findall(r'data-model-name="([^"]+)"', done.stdout) == ["a", "b"]
    shown = dict(re.findall(r'<span data-model="node" data-metric="([^"]+)">([^<]*)</span>', done.stdout))
    assert float(shown["free_handles"]) <= 32 and 0 <= float(shown["free_memory_pct"]) <= 100
    online = re.findall(r'<span data-model="[01]" data-metric="online_requests">([^<]*)</span>', done.stdout)
    assert online == ["1", "1"]
