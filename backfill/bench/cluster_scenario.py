"""The cluster scenario on a real local Ray cluster (Valve §6 end to end):

    3 Ray nodes on 127.0.0.1, a NodeServer actor on each (a node runtime with an online model and a
    batch model, each with its HTTP server), online chat traffic on each through its HTTP endpoint,
    the profile (T_mono alone, and the share of it a node keeps while 2, 3 nodes run at once on the
    machine's shared cores), 3 offline batch jobs submitted to the ClusterService actor; then one
    node's online load is raised until its job misses its SLA and the monitor moves it, and another
    node's process is killed mid-job. Reports every custom_id's count in the outputs, the decisions,
    and the throughput model's prediction against measured throughput.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

from backfill.cluster.monitor import MonitorConfig
from backfill.progress import Heartbeat
from backfill.cluster.node_actor import ONLINE_MODEL, SERVED_MODEL, NodeServer, NodeSpec
from backfill.cluster.ray_cluster import ClusterService, CpuContention
from backfill.cluster.job_scheduler import ClusterSchedulerConfig
from backfill.cluster.throughput_model import JobProfile, OfflineJob

# A local test cluster: Ray must address every node as 127.0.0.1 (on Linux it otherwise picks the
# host's outward address). Read when ray is first imported, which this module does lazily.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts workers 15 nice levels below the raylet; the node processes are what the scenario
# measures, so they run at the priority of the process that started the cluster.
os.environ.setdefault("RAY_worker_niceness", "0")


@dataclass(frozen=True)
class ScenarioConfig:
    nodes: int = 3
    model: str = "tiny"                    # "default": SmolLM2-135M
    max_tokens: int = 16                   # per batch line
    online_rate_per_s: float = 0.5         # Poisson, per node
    saturating_clients: int = 3            # the raised node: closed-loop clients, one always in flight
    sla_share: float = 0.2                 # SLA = share x T_mono (a lone node's offline tokens/s)
    round_s: float = 1.5
    measure_window_s: float = 3.0          # the monitor's check: a job's tokens/s over this window
    node_window_s: float = 4.0             # each node's C_n window
    raise_after_rounds: int = 2
    kill_after_rounds: int = 6             # and not before job0 has moved off the raised node
    job_rounds: float = 10.0               # rounds job0 and job1 take at the expected rate
    short_job_share: float = 0.4           # job2, so that a node frees up for the evicted job
    profile_lines: int = 512               # per node and phase (cancelled when the phase ends)
    profile_warmup_s: float = 1.0
    profile_s: float = 3.0                 # per phase (k = nodes, ..., 1 nodes busy at once)
    timeout_s: float = 150.0               # for the jobs, from their submission
    start_timeout_s: float = 240.0         # Ray and the node processes
    object_store_mb: int = 80

    @classmethod
    def for_model(cls, model: str) -> "ScenarioConfig":
        """The tiny model's defaults, or the default model: slower (tens of tokens/s per node on a
        share of two cores), so longer rounds and windows for the same number of rounds."""
        if model == "tiny":
            return cls()
        return cls(model=model, online_rate_per_s=0.2, round_s=4.0, measure_window_s=8.0, node_window_s=10.0,
                   job_rounds=16.0, profile_lines=96, profile_warmup_s=3.0, profile_s=8.0, timeout_s=200.0,
                   start_timeout_s=240.0)


def _chat_line(custom_id: str, i: int, max_tokens: int) -> str:
    body = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


class OnlineTraffic:
    """Poisson chat requests to each node's HTTP endpoint (rates adjustable while running), and
    closed-loop clients that keep a node's online service busy without a gap (`saturate`)."""

    def __init__(self, urls: dict[str, str], rate_per_s: float) -> None:
        self.urls, self.rates = urls, {n: rate_per_s for n in urls}
        self.sent = {n: 0 for n in urls}
        self._stop = threading.Event()
        self._saturating: dict[str, threading.Event] = {}
        self._threads = [threading.Thread(target=self._drive, args=(n,), daemon=True) for n in urls]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _request(self, client: httpx.Client, node: str, max_tokens: int) -> None:
        try:
            client.post("/v1/chat/completions", json={
                "model": ONLINE_MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Hi!"}]})
            self.sent[node] += 1
        except httpx.HTTPError:
            pass   # the node was killed

    def _drive(self, node: str) -> None:
        rng = random.Random(hash(node) & 0xFFFF)
        with httpx.Client(base_url=self.urls[node], timeout=60) as client:
            while not self._stop.wait(rng.expovariate(self.rates[node])):
                threading.Thread(target=self._request, args=(client, node, 8), daemon=True).start()

    def saturate(self, node: str, clients: int) -> None:
        """Clients of different lengths, so they do not finish together and leave the service idle."""
        done = self._saturating[node] = threading.Event()

        def loop(max_tokens: int) -> None:
            with httpx.Client(base_url=self.urls[node], timeout=60) as client:
                while not (done.is_set() or self._stop.is_set()):
                    self._request(client, node, max_tokens)

        for i in range(clients):
            threading.Thread(target=loop, args=(8 + 5 * i,), daemon=True).start()

    def restore(self, node: str) -> None:
        self._saturating.pop(node).set()

    def stop(self) -> None:
        self._stop.set()
        for done in self._saturating.values():
            done.set()


class CpuShares:
    """Each node's model processes: their share of one core per round (utime + stime from /proc), with
    the job it ran, to tell a throughput miss from a process that got less of the shared CPU."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.rounds: list[dict] = []
        self._last = {n: (time.monotonic(), self._cpu_s(p)) for n, p in pids.items()}

    @classmethod
    def _cpu_s(cls, pids: list[int]) -> float | None:
        each = [cls._one_cpu_s(p) for p in pids]
        return None if None in each else sum(each)

    @staticmethod
    def _one_cpu_s(pid: int) -> float | None:
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


PROFILE_ATTEMPTS = 3   # profile_lines, then 4x and 16x as many where a job runs out


def profile_rates(handles: dict, cfg: ScenarioConfig) -> dict[int, dict[str, float]]:
    """Valve §6's one-off profile, on a machine whose cores the nodes share: the offline tokens/s of
    the first k nodes while k of them run the profile job at once (k = nodes, ..., 1), no online load."""
    import ray

    names = sorted(handles)
    rates: dict[int, dict[str, float]] = {}
    for k in range(len(names), 0, -1):
        busy = names[:k]
        # A faster machine than profile_lines was sized for empties the job inside the window; the
        # phase is run again with four times the lines (a rate needs a job busy throughout).
        for attempt in range(PROFILE_ATTEMPTS):
            count = cfg.profile_lines * 4 ** attempt
            lines = [_chat_line(f"p{i}", i, cfg.max_tokens) for i in range(count)]
            job_id = f"profile{k}-{attempt}"
            for n in busy:
                ray.get(handles[n].start_job.remote(job_id, lines))
            time.sleep(cfg.profile_warmup_s)      # the batch's start-up is not the job's rate
            before = {n: ray.get(handles[n].observe.remote()) for n in busy}
            time.sleep(cfg.profile_s)
            after = {n: ray.get(handles[n].observe.remote()) for n in busy}
            ended = [n for n in busy if ray.get(handles[n].progress.remote(job_id))["ended"]]
            for n in busy:
                ray.get(handles[n].stop_job.remote(job_id))
            if not ended:
                break
        else:
            raise RuntimeError(f"profile with {k} busy nodes: {ended} ran out of {count} lines before the "
                               f"window ended; raise profile_lines ({cfg.profile_lines})")
        rates[k] = {n: (after[n]["offline_tokens"] - before[n]["offline_tokens"]) / (after[n]["t_s"] - before[n]["t_s"])
                    for n in busy}
        if min(rates[k].values()) <= 0:
            raise RuntimeError(f"profile with {k} busy nodes: a node generated no token ({rates[k]})")
    return rates


def run_scenario(cfg: ScenarioConfig = ScenarioConfig(), replay: tuple[list, list] | None = None,
                 log: Callable[[str], None] = lambda line: None) -> dict:
    """The live scenario; with replay=(jobs, fleet rounds), also those rounds decided on a Ray actor.
    `log` gets a line at each stage (minutes on a slow machine) and before the deliberate node kill."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.perf_counter()
    store = cfg.object_store_mb * 2**20
    log(f"starting {cfg.nodes} Ray nodes on 127.0.0.1, each serving {cfg.model} (a minute or more)")
    starting = Heartbeat(log, "starting the Ray nodes and loading their models").__enter__()
    measuring = Heartbeat(log, "measuring each node's offline tokens/s, then a first window with online load")
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
                   .remote(NodeSpec(f"node{i}", model=cfg.model, window_s=cfg.node_window_s))
                   for i, node in enumerate(ray_nodes[:cfg.nodes])}
        infos = {n: ray.get(h.info.remote(), timeout=cfg.start_timeout_s) for n, h in handles.items()}
        starting.stop()
        ready_s = time.perf_counter() - started
        log(f"nodes ready in {ready_s:.0f} s; measuring each node's offline tokens/s alone and side by side")
        replayed = None
        if replay is not None:
            replayed = replay_on_ray(ray.remote(num_cpus=0)(ClusterService).remote(), *replay)

        measuring.__enter__()
        rates = profile_rates(handles, cfg)
        t_mono = rates[1]["node0"]                                 # alone on the machine
        # a share above 1 is the profile's noise: k busy nodes never get more than one alone
        contention = CpuContention(tuple(min(1.0, sum(rates[k].values()) / len(rates[k]) / t_mono)
                                         for k in sorted(rates)))
        profiled_s = time.perf_counter() - started

        traffic = OnlineTraffic({n: i["url"] for n, i in infos.items()}, cfg.online_rate_per_s)
        traffic.start()
        service = ray.remote(num_cpus=0)(ClusterService).remote(
            handles, ClusterSchedulerConfig(), MonitorConfig(misses_to_evict=2, tolerance=0.9), contention,
            cfg.measure_window_s)
        time.sleep(cfg.node_window_s)                     # a first observation window with online load
        profile = JobProfile(t_mono, (0.0, 0.05), (0.0, 1.0))
        # Sized from what a node gets beside the others (job_rounds rounds at that rate); job2 shorter,
        # so that a node frees up for the job the monitor moves.
        per_node = t_mono * contention.share(cfg.nodes)
        lines_per_job = max(8, int(cfg.job_rounds * cfg.round_s * per_node / cfg.max_tokens))
        sizes = {f"job{j}": lines_per_job for j in range(cfg.nodes)}
        sizes[f"job{cfg.nodes - 1}"] = max(4, int(lines_per_job * cfg.short_job_share))
        job_lines = {j: [_chat_line(f"{j}-{i}", i, cfg.max_tokens) for i in range(n)] for j, n in sizes.items()}
        rejection = None
        try:
            ray.get(service.submit.remote(OfflineJob("impossible", profile, 5 * t_mono), job_lines["job0"][:2]))
        except ray.exceptions.RayTaskError as exc:
            rejection = str(exc.cause) if getattr(exc, "cause", None) else str(exc)
        sla = cfg.sla_share * t_mono
        for job_id, lines in job_lines.items():
            ray.get(service.submit.remote(OfflineJob(job_id, profile, sla), lines))
        measuring.stop()
        log(f"T_mono {t_mono:.1f} tokens/s; {len(job_lines)} offline jobs submitted, SLA {sla:.1f} tokens/s each; "
            f"a round every {cfg.round_s:g} s")
        raised = killed = None
        raised_round = restored_round = killed_round = None
        rounds = 0
        timeline = []
        jobs_started = time.perf_counter()
        cpu = CpuShares({n: list(i["model_pids"].values()) for n, i in infos.items()})
        while time.perf_counter() - jobs_started < cfg.timeout_s:
            time.sleep(cfg.round_s)
            ray.get(service.round.remote())
            rounds += 1
            status = ray.get(service.status.remote())
            cpu.sample(rounds, {j: s["node"] for j, s in status.items()})
            timeline.append({"round": rounds, "s": round(time.perf_counter() - jobs_started, 2),
                             "jobs": {j: [s["node"], s["done"]] for j, s in status.items()}})
            if ray.get(service.finished.remote()):
                break
            job0 = status["job0"]["node"]
            if raised is None and rounds >= cfg.raise_after_rounds and job0:
                # Valve §6's case: the node's online load rises until its job misses the SLA; online
                # busy without a gap keeps the gate shut, so the job gets (almost) no tokens.
                raised, raised_round = job0, rounds
                log(f"round {rounds}: raising {raised}'s online load until job0 misses its SLA there")
                traffic.saturate(raised, cfg.saturating_clients)
            elif raised is not None and restored_round is None and job0 not in (None, raised):
                traffic.restore(raised)                   # moved: the burst may end
                restored_round = rounds
                log(f"round {rounds}: job0 moved off {raised} to {job0}")
            if killed is None and rounds >= cfg.kill_after_rounds and restored_round is not None:
                unfinished = [(j, s["node"]) for j, s in sorted(status.items())
                              if s["node"] and s["node"] != raised and s["done"] < s["total"]]
                victims = [n for j, n in unfinished if j != "job0"] or [n for _, n in unfinished]
                if victims:
                    killed, killed_round = victims[0], rounds
                    log(f"round {rounds}: killing {killed}'s process on purpose (SIGKILL) to check that its job "
                        f"moves and every custom_id is still written once; Ray reports it next as \"A worker "
                        f"died or was killed\": that is this kill, not a fault")
                    os.kill(infos[killed]["pid"], signal.SIGKILL)
        outputs = {j: ray.get(service.outputs.remote(j)) for j in job_lines}
        counts = {j: {} for j in job_lines}
        for j, records in outputs.items():
            for r in records:
                counts[j][r["custom_id"]] = counts[j].get(r["custom_id"], 0) + 1
        accuracy = ray.get(service.prediction_error.remote())
        return {
            "config": asdict(cfg), "model": cfg.model, "ready_s": ready_s, "profiled_s": profiled_s,
            "t_mono_tokens_per_s": t_mono, "profile_rates_by_busy_nodes": {str(k): v for k, v in rates.items()},
            "cpu_contention": list(contention.share_by_busy_nodes), "sla_tokens_per_s": sla,
            "rejection": rejection, "raised_node": raised, "raised_round": raised_round,
            "restored_round": restored_round, "killed_node": killed, "killed_round": killed_round, "rounds": rounds,
            "status": ray.get(service.status.remote()), "finished": ray.get(service.finished.remote()),
            "exactly_once": all(len(counts[j]) == len(job_lines[j]) and set(counts[j].values()) == {1}
                                for j in job_lines),
            "lines": {j: len(job_lines[j]) for j in job_lines},
            "events": ray.get(service.events.remote()), "prediction": accuracy, "timeline": timeline,
            "online_sent": dict(traffic.sent), "replayed_decisions": replayed,
            "jobs_s": time.perf_counter() - jobs_started, "wall_s": time.perf_counter() - started,
            "cpu_share_per_round": cpu.rounds,
        }
    finally:
        starting.stop()
        measuring.stop()
        if traffic is not None:
            traffic.stop()
        ray.shutdown()
        cluster.shutdown()
