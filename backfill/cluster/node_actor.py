"""One node of the cluster as a Ray actor: a real node runtime (node/host.py: the compute gate
and shared KV pool) with two model processes on 127.0.0.1, each with its OpenAI HTTP server, Batch
API and SQLite store: the node's online service (`url`) and the engine its offline jobs run on
(`batch_url`). Valve §4: the gate parks the offline engine while the online one has requests in
flight, so a node's offline throughput is what its online load leaves.

    observe()                 the last window: the share of it the gate let offline work run and the
                              online busy share (Valve §6's C_n), busy slices, free KV memory in GB
                              (m_n(t)), and the offline tokens the node has generated so far (lines in
                              progress included), all sampled by the node runtime
    start_job(job_id, lines)  the job's pending lines as a batch through the node's own Batch API
    progress(job_id)          results recorded since the last call, keyed by custom_id
    stop_job(job_id)          cancel the batch (lines in flight are dropped, not recorded) and hand
                              back the last results: the scheduler re-places only what is missing

Ray runs each actor in its own process and the model processes die with it (PR_SET_PDEATHSIG), so
a node can be killed as a whole (os.kill on pid()).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import tempfile
import time
from dataclasses import dataclass

import httpx

from backfill.errors import ClusterError, NodeError


SERVED_MODEL = "backfill"   # every node's batch engine has one name, so a moved job's lines run anywhere
ONLINE_MODEL = "online"     # every node's online service


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    model: str = "default"          # "default": SmolLM2-135M; "tiny": random weights (fast tests)
    policy: str = "priority"        # the batch engine's
    threads: int = 1                # torch threads of each model process
    kv_cache_gb: float = 0.25       # what the pool's handles stand for, in the scheduler's memory terms
    num_handles: int = 64
    blocks_per_handle: int = 4
    max_model_len: int = 512
    sample_interval_s: float = 0.02
    window_s: float = 10.0           # observation window for observe()
    max_offline_in_flight: int = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeServer:
    def __init__(self, spec: NodeSpec) -> None:
        from backfill.node.config import ModelEntry, NodeConfig, NodeSettings
        from backfill.node.host import Node

        self.spec = spec
        self._dir = tempfile.mkdtemp(prefix=f"backfill-{spec.node_id}-")
        self._jobs: dict[str, str] = {}                  # job id -> batch id
        self._reported: dict[str, set[int]] = {}         # job id -> lines already handed back
        self.port, self.batch_port = free_port(), free_port()
        settings = NodeSettings(metrics_port=0, num_handles=spec.num_handles, blocks_per_handle=spec.blocks_per_handle,
                                sample_interval_s=spec.sample_interval_s, window_s=spec.window_s, db_dir=self._dir)
        # sdpa decode attention: several node processes building the C++ kernel at once would queue
        # on torch's extension lock (and a node killed mid-build would leave it held).
        common = dict(model=spec.model, threads=spec.threads, max_model_len=spec.max_model_len,
                      decode_attention="sdpa")
        online = ModelEntry(name=ONLINE_MODEL, port=self.port, policy="online-only", **common)
        batch = ModelEntry(name=SERVED_MODEL, port=self.batch_port, policy=spec.policy,
                           max_offline_in_flight=spec.max_offline_in_flight, **common)
        self.node = Node(NodeConfig(settings, (online, batch)))
        try:
            self.node.start(timeout_s=450)
        except NodeError as exc:
            raise ClusterError(f"node {spec.node_id} did not start: {exc}") from exc
        self._db = self.node.db_path(SERVED_MODEL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def batch_url(self) -> str:
        return f"http://127.0.0.1:{self.batch_port}"

    def info(self) -> dict:
        """Where the node serves, its processes, and the machine whose cores it shares."""
        return {"node_id": self.spec.node_id, "url": self.url, "batch_url": self.batch_url, "pid": os.getpid(),
                "model": self.spec.model, "model_pids": {n: p.pid for n, p in self.node.processes.items()},
                "machine": socket.gethostname(), "cores": len(os.sched_getaffinity(0))}

    def pid(self) -> int:
        return os.getpid()

    # --- observation (Valve §6: C_n from the runtime's gate and online lifecycle, m_n(t) from its pool)

    def observe(self, samples: int = 50) -> dict:
        """The window as `samples` equal slices: busy if online work was in flight in most of it."""
        taken = list(self.node.samples)
        if not taken:
            return {"idle_fraction": 1.0, "online_idle_fraction": 1.0, "busy": [False] * samples,
                    "free_memory_gb": [self.spec.kv_cache_gb] * samples, "offline_tokens": 0, "t_s": time.monotonic()}
        busy = [s.online_busy for s in taken]
        free = [s.free_handles / self.spec.num_handles * self.spec.kv_cache_gb for s in taken]
        step = len(taken) / samples
        cuts = [(int(i * step), max(int(i * step) + 1, int((i + 1) * step))) for i in range(samples)]
        sliced_busy = [sum(busy[a:b]) * 2 > len(busy[a:b]) for a, b in cuts]
        sliced_free = [min(free[a:b]) for a, b in cuts]
        return {"idle_fraction": sum(s.offline_open for s in taken) / len(taken),
                "online_idle_fraction": 1.0 - sum(busy) / len(busy), "busy": sliced_busy,
                "free_memory_gb": sliced_free, "offline_tokens": taken[-1].offline_tokens, "t_s": taken[-1].t_s}

    # --- offline jobs through the node's own Batch API -------------------------------------------

    def start_job(self, job_id: str, lines: list[str]) -> str:
        content = ("\n".join(lines) + "\n").encode()
        with httpx.Client(base_url=self.batch_url, timeout=30) as client:
            file = client.post("/v1/files", files={"file": (f"{job_id}.jsonl", content)}, data={"purpose": "batch"})
            file.raise_for_status()
            batch = client.post("/v1/batches", json={"input_file_id": file.json()["id"],
                                                     "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            batch.raise_for_status()
        self._jobs[job_id] = batch.json()["id"]
        self._reported[job_id] = set()
        return self._jobs[job_id]

    def _new_results(self, job_id: str) -> list[dict]:
        batch_id = self._jobs[job_id]
        conn = sqlite3.connect(f"file:{self._db}?mode=ro", uri=True, timeout=10)
        try:
            rows = conn.execute("SELECT line, custom_id, record FROM batch_results WHERE batch_id = ? AND ok = 1",
                                (batch_id,)).fetchall()
        finally:
            conn.close()
        new = [(line, record) for line, _, record in rows if line not in self._reported[job_id]]
        self._reported[job_id].update(line for line, _ in new)
        return [json.loads(record) for _, record in new]

    def progress(self, job_id: str) -> dict:
        """New results, and whether the node's batch has ended."""
        if job_id not in self._jobs:
            return {"records": [], "ended": True}
        records = self._new_results(job_id)
        with httpx.Client(base_url=self.batch_url, timeout=30) as client:
            status = client.get(f"/v1/batches/{self._jobs[job_id]}").json()["status"]
        return {"records": records, "ended": status in ("completed", "cancelled", "failed", "expired")}

    def stop_job(self, job_id: str, timeout_s: float = 30.0) -> list[dict]:
        """Cancel the job's batch, wait until it ends, and return the results not yet handed back."""
        if job_id not in self._jobs:
            return []
        batch_id = self._jobs[job_id]
        with httpx.Client(base_url=self.batch_url, timeout=30) as client:
            client.post(f"/v1/batches/{batch_id}/cancel")
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if client.get(f"/v1/batches/{batch_id}").json()["status"] in ("cancelled", "completed", "failed"):
                    break
                time.sleep(0.05)
        records = self._new_results(job_id)
        del self._jobs[job_id]
        return records

    def shutdown(self) -> None:
        self.node.stop()
