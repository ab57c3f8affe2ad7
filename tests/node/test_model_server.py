"""`backfill serve --config node.toml` in Python: a node of two tiny models, each with its own
OpenAI endpoint and Batch API under the node runtime's gate and shared memory pool."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from backfill.cluster.node_actor import free_port
from backfill.node.config import ModelEntry, NodeConfig, NodeSettings
from backfill.node.host import Node, job_output_tokens
from backfill.node.ipc import NodeClient


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def chat(url: str, model: str, max_tokens: int = 8, timeout_s: float = 30.0) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=timeout_s,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                         "ignore_eos": True})  # a random tiny model may sample its end token at any step
    assert r.status_code == 200, r.text
    return r.json()


def submit_batch(url: str, model: str, lines: int, max_tokens: int) -> str:
    body = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n"
                   for i in range(lines))
    f = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", body.encode())}, data={"purpose": "batch"})
    b = httpx.post(url + "/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    assert b.status_code == 200, b.text
    return b.json()["id"]


def batch(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}").json()


@pytest.fixture(scope="module")
def node():
    config = NodeConfig(NodeSettings(metrics_port=0, num_handles=32, window_s=30.0),
                        (ModelEntry(name="a", model="tiny", port=free_port(), policy="coserve"),
                         # a's models run the node's defaults (auto dtype, compiled steps); b float32 and eager
                         ModelEntry(name="b", model="tiny", port=free_port(), policy="priority", dtype="float32",
                                    compile_decode=False)))
    with Node(config) as running:
        yield running


def test_each_model_serves_online_and_batches_and_the_node_reports(node):
    for name in ("a", "b"):
        assert chat(node.url(name), name)["usage"]["completion_tokens"] == 8
    batch_id = submit_batch(node.url("b"), "b", lines=3, max_tokens=24)
    wait_for(lambda: batch(node.url("b"), batch_id)["status"] == "completed", what="b's batch")
    assert set(node.runtime.engines()) == {"a", "a/online", "b", "b/online"}
    wait_for(lambda: ("b", batch_id) in node.offline_tokens_per_s(), what="the job's tokens/s")
    text = httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics").text
    assert re.search(r"^backfill_node_idle_compute_fraction 0?\.\d+|^backfill_node_idle_compute_fraction 1\.0", text, re.M)
    assert re.search(r"^backfill_node_free_memory_handles \d+$", text, re.M)
    assert f'backfill_node_offline_tokens_per_second{{model="b",job="{batch_id}"}}' in text
    # generated tokens as the engine steps: at least the recorded lines' completion tokens
    recorded = job_output_tokens(node.db_path("b"))[batch_id]
    wait_for(lambda: node.samples and node.samples[-1].offline_tokens >= recorded > 0, what="generated tokens")
    assert re.search(r"^backfill_node_offline_generated_tokens_per_second \d+\.\d+$", text, re.M)
    assert re.search(r"^backfill_node_offline_open_fraction [01]\.\d+$", text, re.M)
    snapshot = httpx.get(f"http://127.0.0.1:{node.metrics_port}/node").json()
    assert snapshot["free_memory_trace"] and all(0 <= f <= 1 for _, f in snapshot["free_memory_trace"])
    # Both models hold handles of the one pool; what they hold and what is free add up to it.
    held = snapshot["held_handles"]
    assert set(held) == {"a", "b"} and held["a"] > 0 and held["b"] > 0
    assert sum(held.values()) + snapshot["free_handles"] == 32


def test_a_parked_offline_step_does_not_block_its_own_engines_online_requests(node):
    url = node.url("a")
    # Another online service on the device is busy: the gate pauses every model's offline work.
    with NodeClient.connect(node.runtime.socket_path, "other-service", "online", pool=False) as other:
        other.report_busy(["r"])
        wait_for(lambda: node.runtime.offline_paused, what="the gate to close")
        batch_id = submit_batch(url, "a", lines=4, max_tokens=48)
        wait_for(lambda: batch(url, batch_id)["status"] == "in_progress", what="the batch to start")
        time.sleep(1.0)
        assert batch(url, batch_id)["request_counts"]["completed"] == 0    # parked at a safepoint
        assert node.idle_fraction() < 1.0
        started = time.monotonic()
        assert chat(url, "a", max_tokens=8, timeout_s=20.0)["usage"]["completion_tokens"] == 8
        assert time.monotonic() - started < 10.0
        other.report_idle()
        wait_for(lambda: batch(url, batch_id)["status"] == "completed", what="the batch after the gate reopens")
