"""One node of the cluster as a Ray actor: a real serving stack (engine, OpenAI HTTP server with
its Batch API and SQLite store) on 127.0.0.1, plus what the cluster scheduler asks of a node.

    observe()                 the last window: busy samples (online requests in flight), the idle
                              compute fraction, free KV memory in GB (Valve §6's C_n and m_n(t))
    start_job(job_id, lines)  the job's pending lines as a batch through the node's own Batch API
    progress(job_id)          results recorded since the last call, keyed by custom_id
    stop_job(job_id)          cancel the batch (lines in flight are dropped, not recorded) and hand
                              back the last results: the scheduler re-places only what is missing

The engine runs the priority policy on CPU (or coserve where a latency profile exists): offline
lines fill the time online requests leave idle. Ray runs each actor in its own process, so a
node can be killed as a whole (os.kill on pid()).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

import httpx

from backfill.errors import ClusterError


SERVED_MODEL = "backfill"   # every node serves its model under one name, so a moved job's lines run anywhere


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    model: str = "default"          # "default": SmolLM2-135M; "tiny": random weights (fast tests)
    policy: str = "priority"
    threads: int = 1
    kv_cache_gb: float = 0.25
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
        self.spec = spec
        self._dir = tempfile.mkdtemp(prefix=f"backfill-{spec.node_id}-")
        self._db = os.path.join(self._dir, "node.db")
        self._samples: deque[tuple[float, bool, float]] = deque()
        self._jobs: dict[str, str] = {}                  # job id -> batch id
        self._reported: dict[str, set[int]] = {}         # job id -> lines already handed back
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = free_port()
        self._thread = threading.Thread(target=self._serve, name=f"node-{spec.node_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(180) or self._error is not None or not self._server.started:
            raise ClusterError(f"node {spec.node_id} did not start: {self._error}")
        self._sampler = threading.Thread(target=self._sample, name="node-sampler", daemon=True)
        self._sampler.start()

    # --- the serving stack --------------------------------------------------------------------------

    def _serve(self) -> None:
        import uvicorn

        from backfill.server.app import create_app
        from backfill.server.config import ServerConfig
        from backfill.server.store import Store
        from backfill.serving.config import ServingConfig
        from backfill.serving.build import build_engine, build_tiny_engine

        try:
            # sdpa decode attention: several node processes building the C++ kernel at once would queue
            # on torch's extension lock (and a node killed mid-build would leave it held).
            serving = ServingConfig(policy=self.spec.policy, threads=self.spec.threads, device="cpu",
                                    kv_cache_gb=self.spec.kv_cache_gb, max_model_len=self.spec.max_model_len,
                                    decode_attention="sdpa")
            engine = build_tiny_engine(serving) if self.spec.model == "tiny" else build_engine(serving)
            config = ServerConfig(host="127.0.0.1", port=self.port, serving=serving,
                                  max_offline_in_flight=self.spec.max_offline_in_flight, db=self._db,
                                  served_model_name=SERVED_MODEL)
            self._store = Store(self._db)
            self._app = create_app(engine, config, self._store)
            self._engine = engine
            server = uvicorn.Server(uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="warning",
                                                   lifespan="on", access_log=False))
            self._server = server
            loop = asyncio.new_event_loop()
            task = loop.create_task(server.serve())
            while not server.started and not task.done():
                loop.run_until_complete(asyncio.sleep(0.05))
            self._ready.set()
            loop.run_until_complete(task)
        except BaseException as exc:   # reported to the constructor
            self._error = exc
            self._ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self) -> dict:
        return {"node_id": self.spec.node_id, "url": self.url, "pid": os.getpid(), "model": self.spec.model}

    def pid(self) -> int:
        return os.getpid()

    # --- observation (Valve §6: C_n from the runtime's own timeslices, m_n(t) from its pool) ---------

    def _free_memory_gb(self) -> float:
        kv = self._engine.scheduler.kv
        return kv.num_free / max(1, kv.num_blocks) * self.spec.kv_cache_gb

    def _sample(self) -> None:
        state = self._app.state.backfill
        while not self._stop.wait(self.spec.sample_interval_s):
            now = time.monotonic()
            self._samples.append((now, state.in_flight["online"] > 0, self._free_memory_gb()))
            while self._samples and self._samples[0][0] < now - self.spec.window_s:
                self._samples.popleft()

    def observe(self, samples: int = 50) -> dict:
        """The window as `samples` equal slices: busy if online work was in flight in most of it."""
        taken = list(self._samples)
        if not taken:
            return {"idle_fraction": 1.0, "busy": [False] * samples, "free_memory_gb": [self.spec.kv_cache_gb] * samples}
        busy = [b for _, b, _ in taken]
        free = [f for _, _, f in taken]
        step = len(taken) / samples
        sliced_busy = [sum(busy[int(i * step):max(int(i * step) + 1, int((i + 1) * step))]) * 2 >
                       len(busy[int(i * step):max(int(i * step) + 1, int((i + 1) * step))]) for i in range(samples)]
        sliced_free = [min(free[int(i * step):max(int(i * step) + 1, int((i + 1) * step))]) for i in range(samples)]
        return {"idle_fraction": 1.0 - sum(busy) / len(busy), "busy": sliced_busy, "free_memory_gb": sliced_free}

    # --- offline jobs through the node's own Batch API -------------------------------------------

    def start_job(self, job_id: str, lines: list[str]) -> str:
        content = ("\n".join(lines) + "\n").encode()
        with httpx.Client(base_url=self.url, timeout=30) as client:
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
        status = self._store.get_batch(self._jobs[job_id])["status"]
        return {"records": records, "ended": status in ("completed", "cancelled", "failed", "expired")}

    def stop_job(self, job_id: str, timeout_s: float = 30.0) -> list[dict]:
        """Cancel the job's batch, wait until it ends, and return the results not yet handed back."""
        if job_id not in self._jobs:
            return []
        batch_id = self._jobs[job_id]
        with httpx.Client(base_url=self.url, timeout=30) as client:
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
        self._stop.set()
        server = getattr(self, "_server", None)
        if server is not None:
            server.should_exit = True
        self._thread.join(timeout=30)
