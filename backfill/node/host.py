"""A node a user runs: `backfill serve --config node.toml` (Valve §3-§6).

    Node(config).start()   the node runtime (compute gate + shared memory pool) on a private Unix
                           socket, one model process per [[models]] entry (node/model_server.py),
                           each with its own OpenAI endpoint and Batch API, and the node's metrics
                           endpoint on node.metrics_port:

    GET /metrics   Prometheus text: idle fraction of compute over the window (Valve §6's C_n: the
                   share of samples with no online request in flight on any model), free pool
                   memory (handles and fraction), the gate's open share, offline tokens/s
                   generated (lines in progress included), offline tokens/s per job (batch)
                   of each model (recorded lines)
    GET /node      the same as JSON, with the free-memory trace of the window (m_n(t))
    GET /health    200 while the node process runs (from before the models load)
    GET /ready     200 once every model answers its own /ready with 200, else 503
    GET /dashboard the live page (server/dashboard.py's), of every model and the node's gate and memory;
                   GET /dashboard/data is its JSON: each model's /dashboard/data and the node's snapshot

The node samples every node.sample_interval_s: online busy, whether the gate lets offline work
run, free handles, and the offline output tokens the models report generating (counted per engine
step, so lines in progress count: `offline_generated_tokens_per_s`). Offline tokens per job are
read from each model's SQLite store (the output tokens of the batch lines recorded), so they count
only finished lines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from backfill.errors import NodeError
from backfill.node.config import NodeConfig
from backfill.memory.shared_pool import PoolConfig, SharedMemoryPool
from backfill.node.model_server import command_line
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.policy.gate import LifecycleGate, TimesliceGate
from backfill.policy.reclaim import GreedyReclaimPolicy
from backfill.server.static import dashboard_html

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSample:
    t_s: float
    online_busy: bool
    free_handles: int
    offline_open: bool = True          # the gate let offline work run
    offline_tokens: int = 0            # offline output tokens generated on the node so far


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        node = config.node
        gate = LifecycleGate() if node.gate == "lifecycle" else TimesliceGate()
        self.pool = SharedMemoryPool(PoolConfig(num_handles=node.num_handles, blocks_per_handle=node.blocks_per_handle),
                                     reclaim_policy=GreedyReclaimPolicy())
        self.runtime = NodeRuntime(gate, self.pool, RuntimeConfig())
        self._own_db_dir = node.db_dir is None
        self.db_dir = tempfile.mkdtemp(prefix="backfill-node-db-") if self._own_db_dir else node.db_dir
        self.processes: dict[str, subprocess.Popen] = {}
        self.samples: deque[GateSample] = deque()
        self._job_tokens: dict[tuple[str, str], deque[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._metrics_server: ThreadingHTTPServer | None = None
        self._started = threading.Event()   # every model answered /ready once

    # --- lifecycle --------------------------------------------------------------------------------

    def db_path(self, name: str) -> str:
        return os.path.join(self.db_dir, f"{name}.db")

    def url(self, name: str) -> str:
        return f"http://{self.config.node.host}:{self.config.model(name).port}"

    @property
    def metrics_port(self) -> int:
        assert self._metrics_server is not None
        return self._metrics_server.server_address[1]

    def start(self, timeout_s: float = 300.0) -> "Node":
        os.makedirs(self.db_dir, exist_ok=True)
        self.runtime.start()
        try:
            # Bound first: probes see the node alive (/health) and not ready (/ready) while models load.
            self._metrics_server = ThreadingHTTPServer((self.config.node.host, self.config.node.metrics_port),
                                                       _handler(self))
            self._metrics_server.daemon_threads = True
            self._start_thread(self._metrics_server.serve_forever)
            for entry in self.config.models:
                self.processes[entry.name] = subprocess.Popen(
                    command_line(self.runtime.socket_path, self.db_path(entry.name), self.config.node, entry,
                                 len(self.config.models)),
                    env=_child_env())
            self._wait_ready(timeout_s)
            self._started.set()
            self._start_thread(self._sample_loop)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_thread(self, target) -> None:
        t = threading.Thread(target=target, daemon=True, name="node-" + target.__name__)
        t.start()
        self._threads.append(t)

    def ready(self) -> tuple[bool, dict[str, int | None]]:
        """Whether every model answers /ready with 200 now; each model's answer (None: no answer)."""
        answers: dict[str, int | None] = {}
        with httpx.Client(timeout=2.0) as client:
            for entry in self.config.models:
                try:
                    answers[entry.name] = client.get(self.url(entry.name) + "/ready").status_code
                except httpx.HTTPError:
                    answers[entry.name] = None
        return self._started.is_set() and all(code == 200 for code in answers.values()), answers

    def dashboard_data(self, query: str) -> dict[str, Any]:
        """The live page's data: each model's own /dashboard/data and the node's gate and memory."""
        models = []
        with httpx.Client(timeout=5.0) as client:
            for entry in self.config.models:
                try:
                    response = client.get(self.url(entry.name) + "/dashboard/data?" + query)
                    response.raise_for_status()
                    model = response.json()["models"][0]
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                    model = {"error": f"no data from {self.url(entry.name)}: {exc}"}
                models.append({**model, "name": entry.name})
        snapshot = self.snapshot()
        node = {k: snapshot[k] for k in ("idle_fraction", "online_busy", "offline_open_fraction",
                                         "offline_generated_tokens_per_s", "free_handles", "num_handles",
                                         "free_memory_fraction", "free_memory_trace")}
        node.update(gate=self.config.node.gate, window_s=self.config.node.window_s)
        return {"kind": "node", "models": models, "node": node}

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.processes)
        with httpx.Client(timeout=2.0) as client:
            while waiting:
                for name in sorted(waiting):
                    code = self.processes[name].poll()
                    if code is not None:
                        raise NodeError(f"model {name!r} exited with status {code} while starting")
                    try:
                        if client.get(self.url(name) + "/ready").status_code == 200:
                            waiting.discard(name)
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise NodeError(f"models {sorted(waiting)} not ready within {timeout_s} s")
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for t in self._threads:
            t.join(timeout=5)
        self.runtime.stop()
        if self._own_db_dir:
            shutil.rmtree(self.db_dir, ignore_errors=True)

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self) -> int:
        """Until SIGTERM / SIGINT or a model process exits; the exit status."""
        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())
        while not stopped.wait(0.5):
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    log.error("model %s exited with status %s", name, proc.returncode)
                    return 1
        return 0

    # --- observation ------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        node = self.config.node
        next_tokens_s = 0.0
        while not self._stop.wait(node.sample_interval_s):
            now = time.monotonic()
            self.samples.append(GateSample(now, self.runtime.online_busy, self.pool.free_handles,
                                       not self.runtime.offline_paused, self.runtime.offline_tokens()))
            while self.samples and self.samples[0].t_s < now - node.window_s:
                self.samples.popleft()
            if now >= next_tokens_s:   # the stores are read once a second
                next_tokens_s = now + 1.0
                self._sample_job_tokens(now)

    def _sample_job_tokens(self, now: float) -> None:
        for entry in self.config.models:
            for batch_id, tokens in job_output_tokens(self.db_path(entry.name)).items():
                trace = self._job_tokens.setdefault((entry.name, batch_id), deque())
                trace.append((now, tokens))
                while len(trace) > 2 and trace[0][0] < now - self.config.node.window_s:
                    trace.popleft()

    def idle_fraction(self) -> float:
        taken = list(self.samples)
        return 1.0 - sum(s.online_busy for s in taken) / len(taken) if taken else 1.0

    def offline_open_fraction(self) -> float:
        """Share of the window in which the gate let offline work run (online idle past its cooldown)."""
        taken = list(self.samples)
        return sum(s.offline_open for s in taken) / len(taken) if taken else 1.0

    def generated_tokens_per_s(self) -> float:
        """Offline output tokens/s over the window, every model's lines in progress included."""
        taken = list(self.samples)
        if len(taken) < 2 or taken[-1].t_s <= taken[0].t_s:
            return 0.0
        return (taken[-1].offline_tokens - taken[0].offline_tokens) / (taken[-1].t_s - taken[0].t_s)

    def offline_tokens_per_s(self) -> dict[tuple[str, str], float]:
        rates = {}
        for key, trace in list(self._job_tokens.items()):
            (t0, n0), (t1, n1) = trace[0], trace[-1]
            rates[key] = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        return rates

    def snapshot(self) -> dict[str, Any]:
        taken = list(self.samples)
        handles = self.config.node.num_handles
        t_end = taken[-1].t_s if taken else time.monotonic()
        return {"idle_fraction": self.idle_fraction(), "online_busy": self.runtime.online_busy,
                "offline_open_fraction": self.offline_open_fraction(),
                "offline_generated_tokens_per_s": self.generated_tokens_per_s(),
                "offline_generated_tokens": self.runtime.offline_tokens(),   # as the engines reported them
                "free_handles": self.pool.free_handles, "num_handles": handles,
                "free_memory_fraction": self.pool.free_handles / handles,
                "free_memory_trace": [[round(s.t_s - t_end, 3), s.free_handles / handles] for s in taken],
                "offline_tokens_per_s": [{"model": m, "job": b, "tokens_per_s": r}
                                         for (m, b), r in sorted(self.offline_tokens_per_s().items())],
                "models": {e.name: {"url": self.url(e.name), "alive": self.processes[e.name].poll() is None}
                           for e in self.config.models if e.name in self.processes},
                "held_handles": self.runtime.memory_snapshot().get("held", {})}

    def prometheus_text(self) -> str:
        s = self.snapshot()
        lines = ["# HELP backfill_node_idle_compute_fraction Share of the window with no online request in flight",
                 "# TYPE backfill_node_idle_compute_fraction gauge",
                 f"backfill_node_idle_compute_fraction {s['idle_fraction']:.6f}",
                 "# HELP backfill_node_free_memory_handles Free handles of the shared KV pool",
                 "# TYPE backfill_node_free_memory_handles gauge",
                 f"backfill_node_free_memory_handles {s['free_handles']}",
                 "# HELP backfill_node_free_memory_fraction Free share of the shared KV pool",
                 "# TYPE backfill_node_free_memory_fraction gauge",
                 f"backfill_node_free_memory_fraction {s['free_memory_fraction']:.6f}",
                 "# HELP backfill_node_offline_open_fraction Share of the window the gate let offline work run",
                 "# TYPE backfill_node_offline_open_fraction gauge",
                 f"backfill_node_offline_open_fraction {s['offline_open_fraction']:.6f}",
                 "# HELP backfill_node_offline_generated_tokens_per_second Offline output tokens/s generated, "
                 "lines in progress included",
                 "# TYPE backfill_node_offline_generated_tokens_per_second gauge",
                 f"backfill_node_offline_generated_tokens_per_second {s['offline_generated_tokens_per_s']:.6f}",
                 "# HELP backfill_node_offline_tokens_per_second Output tokens/s of each offline job (batch)",
                 "# TYPE backfill_node_offline_tokens_per_second gauge"]
        for job in s["offline_tokens_per_s"]:
            lines.append(f'backfill_node_offline_tokens_per_second{{model="{job["model"]}",job="{job["job"]}"}} '
                         f'{job["tokens_per_s"]:.6f}')
        return "\n".join(lines) + "\n"


def job_output_tokens(db_path: str) -> dict[str, int]:
    """Output tokens of the recorded lines of every batch in a model's store."""
    if not os.path.exists(db_path):
        return {}
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute("SELECT batch_id, SUM(json_extract(record, '$.response.body.usage.completion_tokens')) "
                                "FROM batch_results WHERE ok = 1 GROUP BY batch_id").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return {}
    return {batch_id: int(tokens or 0) for batch_id, tokens in rows}


def _child_env() -> dict[str, str]:
    import backfill

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(backfill.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _handler(node: Node) -> type[BaseHTTPRequestHandler]:
    class NodeHostHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path, _, query = self.path.partition("?")
            status, kind = 200, "application/json"
            if path == "/metrics":
                body, kind = node.prometheus_text().encode(), "text/plain; version=0.0.4"
            elif path == "/node":
                body = json.dumps(node.snapshot()).encode()
            elif path == "/health":
                body = json.dumps({"status": "alive"}).encode()
            elif path == "/ready":
                ok, models = node.ready()
                status, body = (200 if ok else 503), json.dumps({"status": "ok" if ok else "starting",
                                                                   "models": models}).encode()
            elif path == "/dashboard":
                body, kind = dashboard_html().encode(), "text/html; charset=utf-8"
            elif path == "/dashboard/data":
                body = json.dumps(node.dashboard_data(query)).encode()
            else:
                self.send_error(404)
                return
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return NodeHostHandler


def run_node(config_path: str, device: str | None = None) -> int:
    """`backfill serve --config node.toml [--device cuda]`: start the node, serve until SIGTERM / SIGINT."""
    from backfill.node.config import load_node_config, on_device

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = on_device(load_node_config(config_path), device)
    with Node(config) as node:
        for entry in config.models:
            log.info("model %s (%s, policy %s, %s) on %s", entry.name, entry.model, entry.policy, config.node.device,
                     node.url(entry.name))
        log.info("node metrics on http://%s:%d/metrics", config.node.host, node.metrics_port)
        return node.wait()
