"""The cluster on Ray: node runtimes as actors, and a cluster service that holds the offline jobs.

    service = ClusterService(nodes)          # nodes: node id -> NodeServer actor handle
    service.submit(job, lines)               # JobRejectedError when no node can meet the SLA
    service.round()                          # observe nodes, collect results, decide, act
    service.outputs(job_id)                  # one record per custom_id

Every round goes through ClusterController.step (the same object the fleet simulator drives):
`decide` is that step on a snapshot, `round` builds the snapshot from the live nodes first.
Exactly once: the service keeps each job's results keyed by custom_id (first one wins) and sends a
node only the lines without one; a moved job's old batch is cancelled (lines in flight dropped,
recorded ones collected) before its remaining lines start elsewhere. A node that stops answering
is dropped: its jobs go back to the queue and rerun what it had not handed back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from backfill.cluster.controller import ClusterController
from backfill.cluster.monitor import MonitorConfig, SLAMonitor
from backfill.cluster.scheduler import ClusterScheduler, SchedulerConfig
from backfill.cluster.throughput_model import ClusterSnapshot, OfflineJob, predict
from backfill.errors import ClusterInputError, JobRejectedError


@dataclass
class _JobState:
    job: OfflineJob
    lines: dict[str, str]                               # custom_id -> JSONL line
    results: dict[str, dict] = field(default_factory=dict)
    node: str | None = None
    tokens_since_round: int = 0
    moves: int = 0


class ClusterService:
    def __init__(self, nodes: dict | None = None, scheduler: SchedulerConfig = SchedulerConfig(),
                 monitor: MonitorConfig = MonitorConfig()) -> None:
        self.nodes = dict(nodes or {})
        self.controller = ClusterController(ClusterScheduler(scheduler), SLAMonitor(monitor))
        self.jobs: dict[str, _JobState] = {}
        self.log: list[dict] = []                       # every decision and event, in order
        self._last_round_s: float | None = None
        self._predicted: dict[str, tuple[str, float]] = {}
        self._just_placed: set[str] = set()
        self._stays: dict[tuple, dict] = {}             # (job, node, move count) -> its whole rounds there

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
                state.tokens_since_round += record["response"]["body"]["usage"]["completion_tokens"]

    def round(self, check_slas: bool = True) -> dict:
        now = time.monotonic()
        elapsed = None if self._last_round_s is None or not check_slas else now - self._last_round_s
        if check_slas:
            self._last_round_s = now
        observed = {n: self._call(n, "observe") for n in list(self.nodes)}
        observed = {n: o for n, o in observed.items() if o is not None and n in self.nodes}
        finished, measured = [], {}
        for job_id, state in self.jobs.items():
            if state.node is None or state.node not in self.nodes:
                continue
            progress = self._call(state.node, "progress", job_id)
            if progress is None:
                continue
            self._collect(job_id, progress["records"])
            if len(state.results) == len(state.lines):
                self._call(state.node, "stop_job", job_id)
                finished.append(job_id)
                state.node = None
            elif elapsed is not None and job_id in self.controller.running:
                measured[job_id] = state.tokens_since_round / elapsed
                # the round it started in includes the batch's start-up: compare whole rounds only
                if job_id in self._predicted and self._predicted[job_id][0] == state.node \
                        and job_id not in self._just_placed:
                    stay = self._stays.setdefault((job_id, state.node, state.moves), {
                        "job_id": job_id, "node": state.node, "predicted": [], "tokens": 0, "seconds": 0.0})
                    stay["predicted"].append(self._predicted[job_id][1])
                    stay["tokens"] += state.tokens_since_round
                    stay["seconds"] += elapsed
            if check_slas:
                state.tokens_since_round = 0
        if not observed:
            return {"placed": [], "evicted": [], "rejected": [], "waiting": []}
        ids = sorted(observed)
        snapshot = ClusterSnapshot(ids, np.arange(len(ids)), [observed[n]["idle_fraction"] for n in ids],
                                   [observed[n]["free_memory_gb"] for n in ids], [observed[n]["busy"] for n in ids])
        self.decide(snapshot, measured, finished)
        result = self._last_result
        for eviction in result.evicted:
            state = self.jobs[eviction.job_id]
            old = eviction.device_ids[0]
            self._collect(eviction.job_id, self._call(old, "stop_job", eviction.job_id) or [])
            state.node, state.moves = None, state.moves + 1
            self.log.append({"event": "evict", **eviction.as_dict()})
        for placement in result.placed:
            state = self.jobs[placement.job_id]
            node = placement.device_ids[0]
            pending = [line for c, line in state.lines.items() if c not in state.results]
            if pending and self._call(node, "start_job", placement.job_id, pending) is not None:
                state.node = node
                self.log.append({"event": "place", **placement.as_dict(), "lines": len(pending)})
        self._just_placed = {p.job_id for p in result.placed}
        index = {n: i for i, n in enumerate(ids)}
        self._predicted = {j: (p.device_ids[0], predict(self.jobs[j].job.profile, snapshot,
                                                        [index[p.device_ids[0]]]).tokens_per_s)
                           for j, p in self.controller.running.items() if p.device_ids[0] in index}
        for rejection in result.rejected:
            self.log.append({"event": "reject", **rejection.as_dict()})
        return {"placed": [p.as_dict() for p in result.placed], "evicted": [e.as_dict() for e in result.evicted],
                "rejected": [r.as_dict() for r in result.rejected], "waiting": [w.as_dict() for w in result.waiting]}

    def prediction_error(self, min_rounds: int = 3) -> dict:
        """Predicted T_eff (mean over a job's whole rounds on a node) against the throughput it got
        there (tokens / seconds over the same rounds): results arrive a batch of lines at a time,
        so single rounds are noisy. Stays shorter than min_rounds are left out."""
        stays = [{**st, "predicted": float(np.mean(st["predicted"])), "rounds": len(st["predicted"]),
                  "measured": st["tokens"] / st["seconds"]}
                 for st in self._stays.values() if len(st["predicted"]) >= min_rounds and st["seconds"] > 0]
        errors = [abs(st["predicted"] - st["measured"]) / st["measured"] for st in stays if st["measured"] > 0]
        return {"stays": stays, "median_abs_error": float(np.median(errors)) if errors else None,
                "errors": errors}
