"""The cluster on Ray: node runtimes as actors, and a cluster service that holds the offline jobs.

    service = ClusterService(nodes, contention=...)   # nodes: node id -> NodeServer actor handle
    service.submit(job, lines)               # JobRejectedError when no node can meet the SLA
    service.round()                          # observe nodes, collect results, decide, act
    service.outputs(job_id)                  # one record per custom_id

Every round goes through ClusterController.step (the same object the fleet simulator drives):
`decide` is that step on a snapshot, `round` builds the snapshot from the live nodes first.
Exactly once: the service keeps each job's results keyed by custom_id (first one wins) and sends a
node only the lines without one; a moved job's old batch is cancelled (lines in flight dropped,
recorded ones collected) before its remaining lines start elsewhere. A node that stops answering
is dropped: its jobs go back to the queue and rerun what it had not handed back.

What the monitor checks (Valve §6): a job's throughput is the offline tokens its node generated
since the job was placed there (lines in progress included, one cluster job per node), over the
last `measure_window_s`; a round that finishes no line still counts what the engine generated.

C_n of a node that shares a machine's cores with other nodes (a local Ray cluster): the share of
the window its gate let offline work run, times the share of a lone node's speed a node keeps
while that many nodes of the machine are busy (`CpuContention`, measured at start-up).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from backfill.cluster.controller import ClusterController
from backfill.cluster.monitor import MonitorConfig, SLAMonitor
from backfill.cluster.job_scheduler import ClusterScheduler, ClusterSchedulerConfig
from backfill.cluster.throughput_model import ClusterSnapshot, OfflineJob, predict
from backfill.errors import ClusterInputError, JobRejectedError


@dataclass(frozen=True)
class CpuContention:
    """A node's offline speed while k nodes of its machine are busy, as a share of its speed alone
    (k = 1, 2, ...: `share_by_busy_nodes[k - 1]`, measured); 1 for nodes with a device of their own."""

    share_by_busy_nodes: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not self.share_by_busy_nodes or any(not 0 < x <= 1 for x in self.share_by_busy_nodes):
            raise ClusterInputError(f"share_by_busy_nodes must be non-empty shares in (0, 1], "
                                    f"got {self.share_by_busy_nodes}")

    def share(self, busy_nodes: float) -> float:
        """Linear between measured counts; past the last one, the cores split further in proportion."""
        shares = self.share_by_busy_nodes
        k = max(1.0, busy_nodes)
        if k > len(shares):
            return shares[-1] * len(shares) / k
        return float(np.interp(k, np.arange(1, len(shares) + 1), shares))


@dataclass
class _JobState:
    job: OfflineJob
    lines: dict[str, str]                               # custom_id -> JSONL line
    results: dict[str, dict] = field(default_factory=dict)
    node: str | None = None
    moves: int = 0
    generated: deque = field(default_factory=deque)     # (t_s, node's offline tokens) since placed there


class ClusterService:
    def __init__(self, nodes: dict | None = None, scheduler: ClusterSchedulerConfig = ClusterSchedulerConfig(),
                 monitor: MonitorConfig = MonitorConfig(), contention: CpuContention = CpuContention(),
                 measure_window_s: float = 10.0) -> None:
        if not measure_window_s > 0:
            raise ClusterInputError(f"measure_window_s must be > 0, got {measure_window_s}")
        self.nodes = dict(nodes or {})
        self.controller = ClusterController(ClusterScheduler(scheduler), SLAMonitor(monitor))
        self.contention = contention
        self.measure_window_s = measure_window_s
        self.jobs: dict[str, _JobState] = {}
        self.log: list[dict] = []                       # every decision and event, in order
        self._predicted: dict[str, tuple[str, float]] = {}
        self._just_placed: set[str] = set()
        self._stays: dict[tuple, dict] = {}             # (job, node, move count) -> its whole rounds there
        self._machine: dict[str, str] = {}              # node id -> the machine whose cores it shares
        for node_id in list(self.nodes):
            info = self._call(node_id, "info")
            if info is not None:
                self._machine[node_id] = info["machine"]

    # --- jobs ---------------------------------------------------------------------------------------

    def submit(self, job: OfflineJob, lines: list[str]) -> dict:
        by_id: dict[str, str] = {}
        for line in lines:
            custom_id = json.loads(line).get("custom_id")
            if not isinstance(custom_id, str) or custom_id in by_id:
                raise ClusterInputError(f"job {job.job_id}: every line needs a unique string custom_id, got {custom_id!r}")
            by_id[custom_id] = line
        self.controller.submit(job)
        self.jobs[job.job_id] = _JobState(job, by_id)
        if self.nodes:
            # decide at once, but without a monitor check: a check needs a whole round of progress
            result = self.round(check_slas=False)
            rejected = [r for r in result["rejected"] if r["job_id"] == job.job_id]
            if rejected:
                del self.jobs[job.job_id]
                raise JobRejectedError(f"job {job.job_id} rejected: {rejected[0]['reason']}")
        return self.status()[job.job_id]

    def decide(self, snapshot: ClusterSnapshot, measured: dict[str, float], finished: list[str] = ()) -> list[tuple]:
        """One controller round on a given snapshot (the simulator's and the live cluster's path)."""
        for job_id in finished:
            self.controller.finish(job_id)
        self._last_result = self.controller.step(snapshot, measured)
        return self._last_result.decisions()

    def outputs(self, job_id: str) -> list[dict]:
        state = self.jobs[job_id]
        return [state.results[c] for c in state.lines if c in state.results]

    def status(self) -> dict:
        return {j: {"node": s.node, "done": len(s.results), "total": len(s.lines), "moves": s.moves,
                    "queued": j in self.controller.queue} for j, s in self.jobs.items()}

    def events(self) -> list[dict]:
        return list(self.log)

    def finished(self) -> bool:
        return all(len(s.results) == len(s.lines) for s in self.jobs.values())

    # --- a live round -------------------------------------------------------------------------------

    def _call(self, node_id: str, method: str, *args):
        import ray

        try:
            return ray.get(getattr(self.nodes[node_id], method).remote(*args), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._lose(node_id, exc)
            return None

    def _lose(self, node_id: str, exc: BaseException) -> None:
        self.nodes.pop(node_id, None)
        lost = self.controller.lose_devices({node_id})
        for job_id in lost:
            self.jobs[job_id].node = None
            self.jobs[job_id].moves += 1
        self.log.append({"event": "node-lost", "node": node_id, "jobs": lost, "error": type(exc).__name__})

    def _collect(self, job_id: str, records: list[dict]) -> None:
        state = self.jobs[job_id]
        for record in records:
            custom_id = record["custom_id"]
            if custom_id in state.lines and custom_id not in state.results:
                state.results[custom_id] = record

    def _measure(self, state: _JobState, seen: dict) -> float | None:
        """The job's tokens/s over the last measure_window_s of its stay (None: no interval yet)."""
        trace = state.generated
        trace.append((seen["t_s"], seen["offline_tokens"]))
        while len(trace) > 2 and trace[1][0] <= seen["t_s"] - self.measure_window_s:
            trace.popleft()
        (t0, n0), (t1, n1) = trace[0], trace[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def _idle_fractions(self, observed: dict[str, dict], busy_share: dict[str, float]) -> dict[str, float]:
        """C_n: the gate's open share x the CPU share a node keeps beside the busy nodes of its machine."""
        load: dict[str, float] = {}
        for node_id, share in busy_share.items():
            machine = self._machine.get(node_id, node_id)
            load[machine] = load.get(machine, 0.0) + share
        return {n: o["idle_fraction"] * self.contention.share(load[self._machine.get(n, n)])
                for n, o in observed.items()}

    def _snapshot(self, observed: dict[str, dict], idle: dict[str, float]) -> ClusterSnapshot:
        ids = sorted(observed)
        return ClusterSnapshot(ids, np.arange(len(ids)), [idle[n] for n in ids],
                               [observed[n]["free_memory_gb"] for n in ids], [observed[n]["busy"] for n in ids])

    def round(self, check_slas: bool = True) -> dict:
        observed = {n: self._call(n, "observe") for n in list(self.nodes)}
        observed = {n: o for n, o in observed.items() if o is not None and n in self.nodes}
        finished, measured = [], {}
        for job_id, state in self.jobs.items():
            if state.node is None or state.node not in observed:
                continue
            progress = self._call(state.node, "progress", job_id)
            if progress is None:
                continue
            self._collect(job_id, progress["records"])
            seen = observed[state.node]
            last = state.generated[-1] if state.generated else None
            rate = self._measure(state, seen)
            if len(state.results) == len(state.lines):
                self._call(state.node, "stop_job", job_id)
                finished.append(job_id)
                state.node = None
            elif job_id in self.controller.running and job_id not in self._just_placed and rate is not None:
                # the round it started in includes the batch's start-up: check and compare whole rounds only
                if not check_slas:
                    continue
                measured[job_id] = rate
                if job_id in self._predicted and self._predicted[job_id][0] == state.node and last is not None:
                    stay = self._stays.setdefault((job_id, state.node, state.moves), {
                        "job_id": job_id, "node": state.node, "predicted": [], "tokens": 0, "seconds": 0.0})
                    stay["predicted"].append(self._predicted[job_id][1])
                    stay["tokens"] += seen["offline_tokens"] - last[1]
                    stay["seconds"] += seen["t_s"] - last[0]
        if not observed:
            return {"placed": [], "evicted": [], "rejected": [], "waiting": []}
        # Deciding, every node of a machine counts as busy: any free one may get a job this round.
        snapshot = self._snapshot(observed, self._idle_fractions(observed, {n: 1.0 for n in observed}))
        self.decide(snapshot, measured, finished)
        result = self._last_result
        for eviction in result.evicted:
            state = self.jobs[eviction.job_id]
            old = eviction.device_ids[0]
            self._collect(eviction.job_id, self._call(old, "stop_job", eviction.job_id) or [])
            state.node, state.moves = None, state.moves + 1
            state.generated.clear()
            self.log.append({"event": "evict", **eviction.as_dict()})
        for placement in result.placed:
            state = self.jobs[placement.job_id]
            node = placement.device_ids[0]
            pending = [line for c, line in state.lines.items() if c not in state.results]
            if pending and self._call(node, "start_job", placement.job_id, pending) is not None:
                state.node = node
                state.generated = deque([(observed[node]["t_s"], observed[node]["offline_tokens"])])
                self.log.append({"event": "place", **placement.as_dict(), "lines": len(pending)})
        self._just_placed = {p.job_id for p in result.placed}
        # What each running job should get until the next round: the nodes now hosting a job are busy,
        # the others as busy as their online load.
        hosting = {p.device_ids[0] for p in self.controller.running.values()}
        busy_share = {n: 1.0 if n in hosting else 1.0 - o["online_idle_fraction"] for n, o in observed.items()}
        after = self._snapshot(observed, self._idle_fractions(observed, busy_share))
        index = {n: i for i, n in enumerate(after.device_ids)}
        self._predicted = {j: (p.device_ids[0], predict(self.jobs[j].job.profile, after,
                                                        [index[p.device_ids[0]]]).tokens_per_s)
                           for j, p in self.controller.running.items() if p.device_ids[0] in index}
        for rejection in result.rejected:
            self.log.append({"event": "reject", **rejection.as_dict()})
        return {"placed": [p.as_dict() for p in result.placed], "evicted": [e.as_dict() for e in result.evicted],
                "rejected": [r.as_dict() for r in result.rejected], "waiting": [w.as_dict() for w in result.waiting]}

    def prediction_error(self, min_rounds: int = 3) -> dict:
        """Predicted T_eff (mean over a job's whole rounds on a node) against the throughput it got
        there (generated tokens / seconds over the same rounds), per stay and per node (all its stays'
        rounds together). Stays shorter than min_rounds are left out."""
        stays = [{**st, "predicted": float(np.mean(st["predicted"])), "rounds": len(st["predicted"]),
                  "measured": st["tokens"] / st["seconds"]}
                 for st in self._stays.values() if len(st["predicted"]) >= min_rounds and st["seconds"] > 0]
        for st in stays:
            st["error"] = (st["predicted"] - st["measured"]) / st["measured"] if st["measured"] > 0 else None
        errors = [abs(st["error"]) for st in stays if st["error"] is not None]
        per_node: dict[str, dict] = {}
        for st in stays:
            node = per_node.setdefault(st["node"], {"predicted_token_seconds": 0.0, "tokens": 0, "seconds": 0.0})
            node["predicted_token_seconds"] += st["predicted"] * st["seconds"]
            node["tokens"] += st["tokens"]
            node["seconds"] += st["seconds"]
        for node in per_node.values():
            node["predicted"] = node.pop("predicted_token_seconds") / node["seconds"]
            node["measured"] = node["tokens"] / node["seconds"]
            node["error"] = (node["predicted"] - node["measured"]) / node["measured"] if node["measured"] > 0 else None
        return {"stays": stays, "median_abs_error": float(np.median(errors)) if errors else None,
                "errors": errors, "per_node": per_node}
