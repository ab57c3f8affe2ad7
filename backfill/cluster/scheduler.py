"""Valve §6 cluster scheduler: place an offline job only where its predicted throughput meets its SLA.

    session = ClusterScheduler(config).session(snapshot)   # one per decision round
    decision = session.place(job)                          # Placement, or Rejection with a reason

A session caches what a round evaluates many times (each job profile's per-device prediction,
each machine's pairwise busy-alignment matrix), and marks devices occupied as it places, so a
fleet of thousands of devices is decided in numpy instead of a Python loop per device.

A job no device could serve even if the whole cluster were free is rejected for good (its reason
names the best prediction); one that would fit on a device already in use waits for capacity.
Among the feasible devices the scheduler takes the best fit (the lowest prediction that still
meets the SLA), keeping the most idle devices for the jobs that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backfill.cluster.throughput_model import (ClusterSnapshot, JobProfile, OfflineJob, Prediction, memory_factor,
                                               pairwise_alignment, predict)
from backfill.errors import ClusterInputError

CHOICES = ("best-fit", "most-throughput")


@dataclass(frozen=True)
class SchedulerConfig:
    alignment_threshold: float = 0.5   # Valve §6: every pair of a lockstep job's devices must reach it
    sla_headroom: float = 1.0          # place only where prediction >= headroom x SLA
    choice: str = "best-fit"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alignment_threshold <= 1.0:
            raise ClusterInputError(f"alignment_threshold must lie in [0, 1], got {self.alignment_threshold}")
        if not self.sla_headroom > 0:
            raise ClusterInputError(f"sla_headroom must be > 0, got {self.sla_headroom}")
        if self.choice not in CHOICES:
            raise ClusterInputError(f"choice must be one of {CHOICES}, got {self.choice!r}")


@dataclass(frozen=True)
class Placement:
    job_id: str
    device_ids: tuple[str, ...]
    prediction: Prediction

    def as_dict(self) -> dict:
        return {"job_id": self.job_id, "device_ids": list(self.device_ids), **self.prediction.as_dict()}


@dataclass(frozen=True)
class Rejection:
    job_id: str
    reason: str
    best_tokens_per_s: float
    permanent: bool           # False: it would fit on a device that is busy with another job

    def as_dict(self) -> dict:
        return {"job_id": self.job_id, "reason": self.reason, "best_tokens_per_s": self.best_tokens_per_s,
                "permanent": self.permanent}


class ClusterScheduler:
    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config

    def session(self, snapshot: ClusterSnapshot, exclude: dict[str, set[str]] | None = None) -> "PlacementSession":
        return PlacementSession(self.config, snapshot, exclude or {})

    def place(self, job: OfflineJob, snapshot: ClusterSnapshot) -> Placement | Rejection:
        return self.session(snapshot).place(job)


class PlacementSession:
    def __init__(self, config: SchedulerConfig, snapshot: ClusterSnapshot, exclude: dict[str, set[str]]) -> None:
        self.config = config
        self.snapshot = snapshot
        self.free = ~snapshot.occupied.copy()
        self._index = {d: i for i, d in enumerate(snapshot.device_ids)}
        self._exclude = exclude              # job id -> devices it must not return to this round
        self._single: dict[JobProfile, np.ndarray] = {}
        nodes = snapshot.node_of
        order = np.argsort(nodes, kind="stable")
        bounds = np.flatnonzero(np.diff(nodes[order])) + 1
        self._node_devices = np.split(order, bounds)   # device indices per machine
        self._scores: dict[int, np.ndarray] = {}
        self._free_groups: dict[JobProfile, list] = {}     # see _groups
        self._whole: dict[JobProfile, list] = {}
        self._dirty: dict[JobProfile, set[int]] = {}
        self._group_of_device = np.empty(snapshot.num_devices, dtype=np.int64)
        for group, devices in enumerate(self._node_devices):
            self._group_of_device[devices] = group

    # --- per-device predictions ------------------------------------------------------------------

    def single_device_tokens_per_s(self, profile: JobProfile) -> np.ndarray:
        """T_mono x C_n x M for every device (A = 1 on one device)."""
        cached = self._single.get(profile)
        if cached is None:
            s = self.snapshot
            cached = profile.tokens_per_s_mono * s.idle_fraction * memory_factor(profile, s.free_memory_gb)
            self._single[profile] = cached
        return cached

    def _pair_scores(self, group: int) -> np.ndarray:
        scores = self._scores.get(group)
        if scores is None:
            scores = pairwise_alignment(self.snapshot.busy[self._node_devices[group]])
            self._scores[group] = scores
        return scores

    # --- placement -------------------------------------------------------------------------------

    def place(self, job: OfflineJob) -> Placement | Rejection:
        need = job.sla_tokens_per_s * self.config.sla_headroom
        allowed = np.ones(self.snapshot.num_devices, dtype=bool)
        for device_id in self._exclude.get(job.job_id, ()):
            if device_id in self._index:
                allowed[self._index[device_id]] = False
        if job.profile.devices == 1:
            found = self._place_single(job, need, allowed)
        else:
            found = self._place_group(job, need, allowed)
        if isinstance(found, Placement):
            for device_id in found.device_ids:
                index = self._index[device_id]
                self.free[index] = False
                for dirty in self._dirty.values():
                    dirty.add(int(self._group_of_device[index]))
        return found

    def _pick(self, values: np.ndarray) -> int:
        """Index into values of the chosen candidate (all of values meet need)."""
        if self.config.choice == "best-fit":
            return int(np.argmin(values))
        return int(np.argmax(values))

    def _place_single(self, job: OfflineJob, need: float, allowed: np.ndarray) -> Placement | Rejection:
        tps = self.single_device_tokens_per_s(job.profile)
        candidates = np.flatnonzero((tps >= need) & self.free & allowed)
        if candidates.size:
            device = int(candidates[self._pick(tps[candidates])])
            return Placement(job.job_id, (self.snapshot.device_ids[device],),
                             predict(job.profile, self.snapshot, [device]))
        return self._reject(job, float(tps.max(initial=0.0)), bool(((tps >= need) & allowed).any()))

    def _best_group(self, profile: JobProfile, group: int, usable: np.ndarray) -> tuple[np.ndarray, Prediction] | None:
        """The best k devices of one machine whose busy periods align pairwise (greedy from each seed)."""
        devices = self._node_devices[group]
        local = np.flatnonzero(usable[devices])
        k = profile.devices
        if local.size < k:
            return None
        scores = self._pair_scores(group)
        tps = self.single_device_tokens_per_s(profile)[devices]
        order = local[np.argsort(-tps[local], kind="stable")]
        best: tuple[np.ndarray, Prediction] | None = None
        for seed in order:
            chosen = [seed]
            for cand in order:
                if cand != seed and all(scores[cand, c] >= self.config.alignment_threshold for c in chosen):
                    chosen.append(cand)
                    if len(chosen) == k:
                        break
            if len(chosen) < k:
                continue
            picked = np.sort(devices[np.asarray(chosen)])
            prediction = predict(profile, self.snapshot, picked)
            if best is None or prediction.tokens_per_s > best[1].tokens_per_s:
                best = (picked, prediction)
        return best

    def _machine_of(self, device_ids: set[str]) -> set[int]:
        return {int(self._group_of_device[self._index[d]]) for d in device_ids if d in self._index}

    def _groups(self, profile: JobProfile, whole: bool) -> list[tuple[np.ndarray, Prediction] | None]:
        """Each machine's best group for the profile: over its free devices, or (whole) all of them.
        Cached per profile; a placement marks only its machine for recomputation."""
        cache = (self._whole if whole else self._free_groups).get(profile)
        if cache is None:
            cache = [None] * len(self._node_devices)
            dirty = set(range(len(self._node_devices)))
            (self._whole if whole else self._free_groups)[profile] = cache
        else:
            dirty = set() if whole else self._dirty.setdefault(profile, set())
        usable = np.ones_like(self.free) if whole else self.free
        for group in dirty:
            cache[group] = self._best_group(profile, group, usable)
        if not whole:
            self._dirty[profile] = set()
        return cache

    def _place_group(self, job: OfflineJob, need: float, allowed: np.ndarray) -> Placement | Rejection:
        profile = job.profile
        free_groups = list(self._groups(profile, whole=False))
        whole_groups = list(self._groups(profile, whole=True))
        for group in self._machine_of(set(self._exclude.get(job.job_id, ()))):   # rare: an evicted job
            free_groups[group] = self._best_group(profile, group, self.free & allowed)
            whole_groups[group] = self._best_group(profile, group, allowed)
        tps = np.array([found[1].tokens_per_s if found else -1.0 for found in free_groups])
        feasible = np.flatnonzero(tps >= need)
        if feasible.size:
            group = int(feasible[self._pick(tps[feasible])])
            devices, prediction = free_groups[group]
            return Placement(job.job_id, tuple(self.snapshot.device_ids[i] for i in devices), prediction)
        whole_tps = np.array([found[1].tokens_per_s if found else 0.0 for found in whole_groups])
        return self._reject(job, float(whole_tps.max(initial=0.0)), bool((whole_tps >= need).any()))

    def _reject(self, job: OfflineJob, best: float, fits_if_free: bool) -> Rejection:
        k = job.profile.devices
        where = "device" if k == 1 else f"set of {k} aligned devices on one machine"
        if fits_if_free:
            return Rejection(job.job_id, f"every {where} that can give {job.sla_tokens_per_s:g} tokens/s is busy "
                                         f"with other offline jobs; waiting for capacity", best, permanent=False)
        return Rejection(job.job_id, f"no {where} in the cluster can meet the SLA of {job.sla_tokens_per_s:g} "
                                     f"tokens/s: the best predicted throughput is {best:.3g} tokens/s "
                                     f"(T_mono {job.profile.tokens_per_s_mono:g} x idle x memory x alignment)",
                         best, permanent=True)
