"""One decision round of the cluster (Valve §6): the SLA monitor's evictions, then the scheduler's
placements, as a plain object the Ray scheduler actor and the fleet simulator both drive.

    controller = ClusterController()
    controller.submit(job)
    result = controller.step(snapshot, measured_tokens_per_s)   # RoundResult
    controller.finish(job_id); controller.lose_devices(device_ids)

The controller owns which job runs where: the snapshot's `occupied` flags are set from its own
placements, so the same inputs give the same decisions wherever it runs. Evicted jobs come back
to the front of the queue (they were admitted already) and may not return to the devices that
failed them in the round they were evicted; a new job whose SLA no device can meet is rejected
for good with the scheduler's reason.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from backfill.cluster.monitor import MonitorConfig, SLAMonitor
from backfill.cluster.job_scheduler import ClusterScheduler, Placement, Rejection, ClusterSchedulerConfig
from backfill.cluster.throughput_model import ClusterSnapshot, OfflineJob
from backfill.errors import ClusterInputError


@dataclass(frozen=True)
class Eviction:
    job_id: str
    device_ids: tuple[str, ...]
    reason: str

    def as_dict(self) -> dict:
        return {"job_id": self.job_id, "device_ids": list(self.device_ids), "reason": self.reason}


@dataclass
class RoundResult:
    placed: list[Placement] = field(default_factory=list)
    evicted: list[Eviction] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)   # for good
    waiting: list[Rejection] = field(default_factory=list)    # queued until capacity frees up

    def decisions(self) -> list[tuple]:
        """The round's decisions in a canonical, comparable form."""
        return ([("evict", e.job_id, e.device_ids) for e in self.evicted]
                + [("place", p.job_id, p.device_ids) for p in self.placed]
                + [("reject", r.job_id) for r in self.rejected])


class ClusterController:
    def __init__(self, scheduler: ClusterScheduler | None = None, monitor: SLAMonitor | None = None) -> None:
        self.scheduler = scheduler or ClusterScheduler(ClusterSchedulerConfig())
        self.monitor = monitor or SLAMonitor(MonitorConfig())
        self.jobs: dict[str, OfflineJob] = {}
        self.queue: OrderedDict[str, None] = OrderedDict()
        self.running: dict[str, Placement] = {}
        self.admitted: set[str] = set()     # placed at least once: never rejected for good afterwards
        self.evictions = 0

    def submit(self, job: OfflineJob) -> None:
        if job.job_id in self.jobs:
            raise ClusterInputError(f"job {job.job_id!r} was already submitted")
        self.jobs[job.job_id] = job
        self.queue[job.job_id] = None

    def finish(self, job_id: str) -> None:
        self.running.pop(job_id, None)
        self.queue.pop(job_id, None)
        self.monitor.forget(job_id)

    def lose_devices(self, device_ids: set[str]) -> list[str]:
        """Devices that died: their jobs go back to the front of the queue."""
        lost = [j for j, p in self.running.items() if set(p.device_ids) & set(device_ids)]
        for job_id in reversed(lost):
            del self.running[job_id]
            self.monitor.forget(job_id)
            self.queue[job_id] = None
            self.queue.move_to_end(job_id, last=False)
        return lost

    def step(self, snapshot: ClusterSnapshot, measured_tokens_per_s: dict[str, float]) -> RoundResult:
        result = RoundResult()
        exclude: dict[str, set[str]] = {}
        for job_id, tokens_per_s in sorted(measured_tokens_per_s.items()):
            placement = self.running.get(job_id)
            if placement is None:
                continue
            sla = self.jobs[job_id].sla_tokens_per_s
            if self.monitor.observe(job_id, tokens_per_s, sla):
                reason = (f"{self.monitor.config.misses_to_evict} checks in a row below its SLA "
                          f"({tokens_per_s:.3g} < {sla:g} tokens/s at the last)")
                result.evicted.append(Eviction(job_id, placement.device_ids, reason))
                exclude[job_id] = set(placement.device_ids)
        for eviction in reversed(result.evicted):
            del self.running[eviction.job_id]
            self.monitor.forget(eviction.job_id)
            self.queue[eviction.job_id] = None
            self.queue.move_to_end(eviction.job_id, last=False)
            self.evictions += 1
        index = {d: i for i, d in enumerate(snapshot.device_ids)}
        occupied = np.zeros(snapshot.num_devices, dtype=bool)
        for placement in self.running.values():
            for device_id in placement.device_ids:
                if device_id in index:
                    occupied[index[device_id]] = True
        snapshot.occupied = occupied
        session = self.scheduler.session(snapshot, exclude)
        for job_id in list(self.queue):
            decision = session.place(self.jobs[job_id])
            if isinstance(decision, Placement):
                del self.queue[job_id]
                self.running[job_id] = decision
                self.admitted.add(job_id)
                result.placed.append(decision)
            elif decision.permanent and job_id not in self.admitted:
                del self.queue[job_id]
                del self.jobs[job_id]
                result.rejected.append(decision)
            else:
                result.waiting.append(decision)
        return result
