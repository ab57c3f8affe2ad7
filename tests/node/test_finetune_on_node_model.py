"""A fine-tuning job on a node's model (`backfill serve --config node.toml`, a real process) runs to
completion beside the model's batch work, while the node's token reporter keeps reporting: both are
between-steps tasks of the one engine (AsyncEngine.add_between_steps_task), neither takes the other's slot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backfill.cluster.node_actor import free_port
from backfill.finetune.colocate import harli_profile_path
from backfill.policy.harli import HarliLatencyModel, SoloFit
from tests.node.test_model_server import wait_for

REPO = Path(__file__).resolve().parents[2]
MODEL = "chat"
TINY_MODEL_NAME = "tiny-random"   # ModelConfig.tiny().name: the name the HARLI profile is kept under
TRAINING = [("What is the capital of France?", "Paris."), ("Name a color.", "Blue."),
            ("What is 2+2?", "Four."), ("Say hi.", "Hi!")]


def ready(metrics_url: str) -> bool:
    try:
        return httpx.get(metrics_url + "/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def reported_offline_tokens(metrics_url: str) -> int:
    return int(httpx.get(metrics_url + "/node", timeout=5.0).json()["offline_generated_tokens"])


def submit_batch(url: str, lines: int, max_tokens: int) -> str:
    body = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                                        "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n"
                   for i in range(lines))
    f = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", body.encode())}, data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    b = httpx.post(url + "/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    assert b.status_code == 200, b.text
    return b.json()["id"]


def batch_status(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10.0).json()


def create_finetuning_job(url: str) -> str:
    content = "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                      + "\n" for q, a in TRAINING).encode()
    f = httpx.post(url + "/v1/files", files={"file": ("train.jsonl", content)}, data={"purpose": "fine-tune"})
    assert f.status_code == 200, f.text
    job = httpx.post(url + "/v1/fine_tuning/jobs", timeout=30.0, json={
        "model": MODEL, "training_file": f.json()["id"], "seed": 7,
        "hyperparameters": {"n_epochs": 3, "batch_size": 2, "micro_batch_size": 1, "max_seq_len": 64,
                            "max_steps": 6},
        "lora": {"rank": 4, "alpha": 8}})
    assert job.status_code == 200, job.text
    return job.json()["id"]


@pytest.fixture
def node_process(tmp_path, monkeypatch):
    """`backfill serve --config node.toml` with one tiny model, stopped whatever the test does. Its
    engine takes pool memory a 256-block handle at a time, so its free blocks between steps hold a
    short job's step (64-token samples) beside the finetuning reserve and the batch's prompts."""
    # A HARLI profile that predicts decode as cheap: units run between decode steps, not only in
    # gaps with no decode at all (the pause-only fallback would wait for the batch to end).
    monkeypatch.setenv("BACKFILL_CACHE_DIR", str(tmp_path / "cache"))
    HarliLatencyModel((SoloFit(1.0, 0.0, 0.01, 0.0),), b1=1.0, k1=1.0,
                      model_name=TINY_MODEL_NAME).save(harli_profile_path(TINY_MODEL_NAME))
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "node.toml"
    config.write_text(f"""
[node]
metrics_port = {metrics_port}
num_handles = 4
blocks_per_handle = 256
db_dir = "{tmp_path / 'db'}"

[[models]]
name = "{MODEL}"
model = "tiny"
port = {port}
policy = "coserve"
dtype = "float32"
compile_decode = false
max_offline_in_flight = 4
""")
    log = (tmp_path / "node.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "backfill", "serve", "--config", str(config)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True)
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    try:
        deadline = time.monotonic() + 240
        while not ready(metrics_url):
            assert proc.poll() is None, (tmp_path / "node.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the node did not become ready"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", metrics_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def test_a_finetuning_job_runs_on_a_node_model_while_it_serves_batches_and_reports_tokens(node_process):
    url, metrics_url = node_process
    batch_id = submit_batch(url, lines=200, max_tokens=128)   # outlasts the job by far
    wait_for(lambda: reported_offline_tokens(metrics_url) > 0, 60, "the node to report offline tokens")

    job_id = create_finetuning_job(url)
    tokens_at_start = reported_offline_tokens(metrics_url)
    batch_running_during_job = False
    deadline = time.monotonic() + 300
    while True:
        job = httpx.get(f"{url}/v1/fine_tuning/jobs/{job_id}", timeout=10.0).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, f"the job is still {job['status']}"
        batch_running_during_job |= batch_status(url, batch_id)["status"] == "in_progress"
        time.sleep(0.2)
    tokens_at_end = reported_offline_tokens(metrics_url)
    batch_after_job = batch_status(url, batch_id)

    assert job["status"] == "succeeded", job
    assert job["fine_tuned_model"], job
    assert batch_running_during_job and batch_after_job["status"] == "in_progress", batch_after_job
    assert tokens_at_end > tokens_at_start   # the reporter went on beside the job
    assert httpx.post(f"{url}/v1/batches/{batch_id}/cancel", timeout=10.0).status_code == 200
