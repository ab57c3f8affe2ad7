"""The cluster scenario on a real local Ray cluster (Valve §6 end to end):

    3 Ray nodes on 127.0.0.1, a NodeServer actor on each (engine + HTTP server + Batch API),
    online chat traffic on each through its HTTP endpoint, T_mono profiled once (all nodes at
    once, no online traffic), 3 offline batch jobs submitted to the ClusterService actor;
    then one node's online load is raised until its job misses its SLA and the monitor moves it,
    and another node's process is killed mid-job. Reports every custom_id's count in the
    outputs, the decisions, and the throughput model's prediction against measured throughput.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass

import httpx

from backfill.cluster.monitor import MonitorConfig
from backfill.cluster.node_actor import SERVED_MODEL, NodeServer, NodeSpec
from backfill.cluster.ray_cluster import ClusterService
from backfill.cluster.scheduler import SchedulerConfig
from backfill.cluster.throughput_model import JobProfile, OfflineJob

# A local test cluster: Ray must address every node as 127.0.0.1 (on Linux it otherwise picks the
# host's outward address). Read when ray is first imported, which this module does lazily.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@dataclass(frozen=True)
class ScenarioConfig:
    nodes: int = 3
    model: str = "tiny"                    # "default" (SmolLM2-135M) where 3 copies fit the cores
    lines_per_job: int = 96
    max_tokens: int = 16
    profile_lines: int = 32               # T_mono's profile, per node
    online_rate_per_s: float = 0.5         # Poisson, per node
    raised_rate_per_s: float = 20.0        # the node whose job must miss its SLA
    sla_share: float = 0.15                # SLA = share x T_mono (low: a loaded shared machine slows online too)
    round_s: float = 2.0
    raise_after_rounds: int = 2
    kill_after_rounds: int = 6
    job_rounds: int = 12                   # rounds one job would take alone at T_mono
    timeout_s: float = 300.0               # for the jobs, from their submission
    start_timeout_s: float = 480.0         # Ray and the node processes (slow on a loaded machine)
    object_store_mb: int = 80

    @classmethod
    def for_model(cls, model: str) -> "ScenarioConfig":
        """The tiny model's defaults, or a default-model run sized for 3 model processes on 2 shared
        cores (a few tokens/s each): fewer, shorter lines, lighter online load, longer rounds."""
        if model == "tiny":
            return cls()
        return cls(model=model, lines_per_job=12, max_tokens=8, profile_lines=8, online_rate_per_s=0.1,
                   raised_rate_per_s=1.0, round_s=5.0, raise_after_rounds=2, kill_after_rounds=4, job_rounds=8,
                   timeout_s=270.0)


def _chat_line(custom_id: str, i: int, max_tokens: int) -> str:
    body = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


class OnlineTraffic:
    """Poisson chat requests to each node's HTTP endpoint, rates adjustable while running."""

    def __init__(self, urls: dict[str, str], rate_per_s: float) -> None:
        self.urls, self.rates = urls, {n: rate_per_s for n in urls}
        self.sent = {n: 0 for n in urls}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._drive, args=(n,), daemon=True) for n in urls]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _drive(self, node: str) -> None:
        rng = random.Random(hash(node) & 0xFFFF)
        with httpx.Client(base_url=self.urls[node], timeout=30) as client:
            pending: list[threading.Thread] = []
            while not self._stop.wait(rng.expovariate(self.rates[node])):
                def one() -> None:
                    try:
                        client.post("/v1/chat/completions", json={
                            "model": SERVED_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi!"}]})
                        self.sent[node] += 1
                    except httpx.HTTPError:
                        pass   # the node was killed
                t = threading.Thread(target=one, daemon=True)
                t.start()
                pending = [p for p in pending if p.is_alive()] + [t]

    def stop(self) -> None:
        self._stop.set()


class CpuShares:
    """Each node's model process: its share of one core per round (utime + stime from /proc), with
    the job it ran, to tell a throughput miss from a process that got less of the shared CPU."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.rounds: list[dict] = []
        self._last = {n: (time.monotonic(), self._cpu_s(p)) for n, p in pids.items()}

    @staticmethod
    def _cpu_s(pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def sample(self, round_index: int, job_nodes: dict[str, str | None]) -> None:
        now = time.monotonic()
        shares = {}
        for n, pid in self.pids.items():
            cpu_s = self._cpu_s(pid)
            t0, c0 = self._last[n]
            shares[n] = None if cpu_s is None or c0 is None else round((cpu_s - c0) / (now - t0), 3)
            self._last[n] = (now, cpu_s)
        self.rounds.append({"round": round_index, "cpu_share": shares,
                            "jobs": {n: sorted(j for j, node in job_nodes.items() if node == n) for n in self.pids}})


def replay_on_ray(service, jobs: list[OfflineJob], rounds: list) -> list[list[tuple]]:
    """The fleet simulator's rounds (fleet_sim.RoundRecord) decided again by a ClusterService actor."""
    import ray

    for job in jobs:
        ray.get(service.submit.remote(job, [json.dumps({"custom_id": job.job_id})]))
    return [[tuple(tuple(x) if isinstance(x, list) else x for x in d)
             for d in ray.get(service.decide.remote(r.snapshot, r.measured, r.finished))] for r in rounds]


def run_scenario(cfg: ScenarioConfig = ScenarioConfig(), replay: tuple[list, list] | None = None) -> dict:
    """The live scenario; with replay=(jobs, fleet rounds), also those rounds decided on a Ray actor."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.perf_counter()
    store = cfg.object_store_mb * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": store, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    traffic = None
    try:
        for _ in range(cfg.nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=store, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        ray_nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        actor = ray.remote(num_cpus=0, max_restarts=0)(NodeServer)
        handles = {f"node{i}": actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                   .remote(NodeSpec(f"node{i}", model=cfg.model)) for i, node in enumerate(ray_nodes[:cfg.nodes])}
        infos = {n: ray.get(h.info.remote(), timeout=cfg.start_timeout_s) for n, h in handles.items()}
        ready_s = time.perf_counter() - started
        replayed = None
        if replay is not None:
            replayed = replay_on_ray(ray.remote(num_cpus=0)(ClusterService).remote(), *replay)

        # Valve §6: T_mono profiled once at submission, here on every node at once without online load
        profile_lines = [_chat_line(f"p{i}", i, cfg.max_tokens) for i in range(cfg.profile_lines)]
        started_profile = time.monotonic()
        for n, h in handles.items():
            ray.get(h.start_job.remote("profile", profile_lines))
        # rate from the first results to the last, so the batch's start-up is not counted; where every
        # result came in one poll, from the job's start instead
        first_tokens = {n: 0 for n in handles}
        first = {n: None for n in handles}
        last = {n: None for n in handles}
        tokens = {n: 0 for n in handles}
        done = {n: False for n in handles}
        while not all(done.values()):
            time.sleep(0.2)
            for n, h in handles.items():
                if done[n]:
                    continue
                p = ray.get(h.progress.remote("profile"))
                got = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in p["records"])
                if got and first[n] is None:
                    first[n] = time.monotonic()
                    first_tokens[n] = got
                elif got:
                    tokens[n] += got
                    last[n] = time.monotonic()
                done[n] = p["ended"]
        for h in handles.values():
            ray.get(h.stop_job.remote("profile"))

        def rate(n: str) -> float:
            if first[n] is None:
                raise RuntimeError(f"{n} finished its profile job without generating a token")
            if last[n] is not None and last[n] > first[n]:
                return tokens[n] / (last[n] - first[n])
            return first_tokens[n] / max(first[n] - started_profile, 1e-3)

        t_mono = sum(rate(n) for n in handles) / len(handles)

        traffic = OnlineTraffic({n: i["url"] for n, i in infos.items()}, cfg.online_rate_per_s)
        traffic.start()
        service = ray.remote(num_cpus=0)(ClusterService).remote(
            handles, SchedulerConfig(), MonitorConfig(misses_to_evict=2, tolerance=0.9))
        time.sleep(3.0)                                   # a first observation window with online load
        profile = JobProfile(t_mono, (0.0, 0.05), (0.0, 1.0))
        # Jobs long enough to outlast the raise and the kill on a fast machine too (job_rounds at T_mono).
        lines_per_job = max(cfg.lines_per_job, int(cfg.job_rounds * cfg.round_s * t_mono / cfg.max_tokens))
        job_lines = {f"job{j}": [_chat_line(f"job{j}-{i}", i, cfg.max_tokens) for i in range(lines_per_job)]
                     for j in range(cfg.nodes)}
        rejection = None
        try:
            ray.get(service.submit.remote(OfflineJob("impossible", profile, 5 * t_mono), job_lines["job0"][:2]))
        except ray.exceptions.RayTaskError as exc:
            rejection = str(exc.cause) if getattr(exc, "cause", None) else str(exc)
        for job_id, lines in job_lines.items():
            ray.get(service.submit.remote(OfflineJob(job_id, profile, cfg.sla_share * t_mono), lines))
        raised = killed = None
        rounds = 0
        jobs_started = time.perf_counter()
        cpu = CpuShares({n: i["model_pid"] for n, i in infos.items()})
        while time.perf_counter() - jobs_started < cfg.timeout_s:
            time.sleep(cfg.round_s)
            ray.get(service.round.remote())
            rounds += 1
            status = ray.get(service.status.remote())
            cpu.sample(rounds, {j: s["node"] for j, s in status.items()})
            if ray.get(service.finished.remote()):
                break
            if raised is None and rounds >= cfg.raise_after_rounds and status["job0"]["node"]:
                raised = status["job0"]["node"]
                traffic.rates[raised] = cfg.raised_rate_per_s
            elif raised is not None and status["job0"]["node"] == raised:
                # The load keeps rising until job0 misses its SLA and the monitor moves it.
                traffic.rates[raised] *= 1.5
            if rounds >= cfg.kill_after_rounds and killed is None:
                victims = [s["node"] for j, s in sorted(status.items()) if s["node"] and s["node"] != raised
                           and s["done"] < s["total"]]
                if victims:
                    killed = victims[0]
                    os.kill(infos[killed]["pid"], signal.SIGKILL)
        outputs = {j: ray.get(service.outputs.remote(j)) for j in job_lines}
        counts = {j: {} for j in job_lines}
        for j, records in outputs.items():
            for r in records:
                counts[j][r["custom_id"]] = counts[j].get(r["custom_id"], 0) + 1
        accuracy = ray.get(service.prediction_error.remote())
        return {
            "config": asdict(cfg), "model": cfg.model, "ready_s": ready_s, "t_mono_tokens_per_s": t_mono,
            "rejection": rejection, "raised_node": raised, "killed_node": killed, "rounds": rounds,
            "status": ray.get(service.status.remote()), "finished": ray.get(service.finished.remote()),
            "exactly_once": all(len(counts[j]) == len(job_lines[j]) and set(counts[j].values()) == {1}
                                for j in job_lines),
            "lines": {j: len(job_lines[j]) for j in job_lines},
            "events": ray.get(service.events.remote()), "prediction": accuracy,
            "online_sent": dict(traffic.sent), "replayed_decisions": replayed, "wall_s": time.perf_counter() - started,
            "cpu_share_per_round": cpu.rounds,
        }
    finally:
        if traffic is not None:
            traffic.stop()
        ray.shutdown()
        cluster.shutdown()
