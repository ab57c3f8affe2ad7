"""Valve §6 cluster scheduler: place an offline job only where its predicted throughput meets its SLA.

    session = ClusterScheduler(config).session(snapshot)   # one per decision round
    decision = session.place(job)                          # Placement, or Rejection with a reason

A session caches what a round evaluates many times (each job profile's per-device prediction,
each machine's pairwise busy-alignment matrix), and marks devices occupied as it places, so a
fleet of thousands of devices is decided in numpy instead of a Python loop per device.

A job no device could serve even if the whole cluster were free is rejected for good (its reason
names the best prediction); one that would fit on a device already in use waits for capacity.
Among the feasible devices the scheduler takes the one with the highest prediction (or, with
choice="best-fit", the lowest that still meets the SLA). In the fleet simulator best fit left jobs
at the edge of their SLA, where one noisy minute of online load made the monitor evict them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backfill.cluster.throughput_model import (ClusterSnapshot, JobProfile, OfflineJob, Prediction, alignment_factor,
                                               memory_factor, pairwise_alignment, predict)
from backfill.errors import ClusterInputError

CHOICES = ("best-fit", "most-throughput")


@dataclass(frozen=True)
class ClusterSchedulerConfig:
    alignment_threshold: float = 0.5   # Valve §6: every pair of a lockstep job's devices must reach it
    sla_headroom: float = 1.0          # place only where prediction >= headroom x SLA
    choice: str = "most-throughput"   # best fit leaves jobs at the edge, where a noisy check evicts them

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
    def __init__(self, config: ClusterSchedulerConfig = ClusterSchedulerConfig()) -> None:
        self.config = config

    def session(self, snapshot: ClusterSnapshot, exclude: dict[str, set[str]] | None = None) -> "PlacementSession":
        return PlacementSession(self.config, snapshot, exclude or {})

    def place(self, job: OfflineJob, snapshot: ClusterSnapshot) -> Placement | Rejection:
        return self.session(snapshot).place(job)


class PlacementSession:
    def __init__(self, config: ClusterSchedulerConfig, snapshot: ClusterSnapshot, exclude: dict[str, set[str]]) -> None:
        self.config = config
        self.snapshot = snapshot
        self.free = ~snapshot.occupied.copy()
        self._index = {d: i for i, d in enumerate(snapshot.device_ids)}
        self._exclude = exclude              # job id -> devices it must not return to this round
        self._single: dict[JobProfile, np.ndarray] = {}
        self._memory_factor: dict[JobProfile, np.ndarray] = {}
        nodes = snapshot.node_of
        order = np.argsort(nodes, kind="stable")
        bounds = np.flatnonzero(np.diff(nodes[order])) + 1
        self._node_devices = np.split(order, bounds)   # device indices per machine
        self._scores: dict[int, np.ndarray] = {}
        self._group_cache: dict[tuple[JobProfile, int, bool], tuple[np.ndarray, Prediction] | None] = {}
        width = max(len(devices) for devices in self._node_devices) if self._node_devices else 0
        self._padded = np.full((len(self._node_devices), width), -1, dtype=np.int64)   # device indices per machine
        for group, devices in enumerate(self._node_devices):
            self._padded[group, :len(devices)] = devices
        self._group_of_device = np.empty(snapshot.num_devices, dtype=np.int64)
        for group, devices in enumerate(self._node_devices):
            self._group_of_device[devices] = group

    # --- per-device predictions ------------------------------------------------------------------

    def single_device_tokens_per_s(self, profile: JobProfile) -> np.ndarray:
        """T_mono x C_n x M for every device (A = 1 on one device)."""
        cached = self._single.get(profile)
        if cached is None:
            s = self.snapshot
            cached = profile.tokens_per_s_mono * s.idle_fraction * self._memory(profile)
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
                group = int(self._group_of_device[index])
                for key in [key for key in self._group_cache if key[1] == group and not key[2]]:
                    del self._group_cache[key]
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

    def _memory(self, profile: JobProfile) -> np.ndarray:
        cached = self._memory_factor.get(profile)
        if cached is None:
            cached = memory_factor(profile, self.snapshot.free_memory_gb)
            self._memory_factor[profile] = cached
        return cached

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
        ok = scores >= self.config.alignment_threshold
        tried: set[tuple[int, ...]] = set()
        best: tuple[np.ndarray, Prediction] | None = None
        for seed in order:
            chosen = [seed]
            for cand in order:
                if cand != seed and ok[cand, chosen].all():
                    chosen.append(cand)
                    if len(chosen) == k:
                        break
            key = tuple(sorted(chosen))
            if len(chosen) < k or key in tried:
                continue
            tried.add(key)
            local_pick = np.array(key)
            picked = devices[local_pick]
            # T_mono x C x M x A from the session's cached factors (throughput_model.predict, without
            # recomputing each device's memory factor and the machine's pair scores per candidate).
            busy = self.snapshot.busy[picked]
            idle = self.snapshot.idle_fraction[picked]
            compute = float(idle.mean())
            memory = float(self._memory(profile)[picked].min())
            alignment = alignment_factor(busy, idle)
            pair = scores[np.ix_(local_pick, local_pick)][np.triu_indices(k, 1)]
            prediction = Prediction(profile.tokens_per_s_mono * compute * memory * alignment, compute, memory,
                                    alignment, float(pair.min()))
            if best is None or prediction.tokens_per_s > best[1].tokens_per_s:
                best = (picked, prediction)
        return best

    def _machine_of(self, device_ids: set[str]) -> set[int]:
        return {int(self._group_of_device[self._index[d]]) for d in device_ids if d in self._index}

    def _upper_bounds(self, profile: JobProfile, usable: np.ndarray) -> np.ndarray:
        """Per machine, a bound on any k-device group's T_eff: the k most idle usable devices' mean
        idle fraction x the best usable memory factor (alignment <= 1). -1 where fewer than k are usable."""
        pad = self._padded
        ok = (pad >= 0) & usable[np.maximum(pad, 0)]
        idle = np.where(ok, self.snapshot.idle_fraction[np.maximum(pad, 0)], 0.0)
        top = -np.sort(-idle, axis=1)[:, :profile.devices]
        memory = np.where(ok, self._memory(profile)[np.maximum(pad, 0)], 0.0).max(axis=1)
        bound = profile.tokens_per_s_mono * top.mean(axis=1) * memory
        return np.where(ok.sum(axis=1) >= profile.devices, bound, -1.0)

    def _group(self, profile: JobProfile, group: int, whole: bool, allowed: np.ndarray,
               excluded: bool) -> tuple[np.ndarray, Prediction] | None:
        usable = allowed if whole else self.free & allowed
        if excluded:          # an evicted job's own view of the machine it left: not shared
            return self._best_group(profile, group, usable)
        key = (profile, group, whole)
        if key not in self._group_cache:
            self._group_cache[key] = self._best_group(profile, group, usable)
        return self._group_cache[key]

    def _place_group(self, job: OfflineJob, need: float, allowed: np.ndarray) -> Placement | Rejection:
        """Machines in order of their bound; exact groups only until no bound can beat what was found."""
        profile = job.profile
        touched = self._machine_of(set(self._exclude.get(job.job_id, ())))
        bounds = self._upper_bounds(profile, self.free & allowed)
        best: tuple[np.ndarray, Prediction] | None = None
        best_any = 0.0
        for group in np.argsort(-bounds, kind="stable"):
            if bounds[group] < need or (best is not None and self.config.choice == "most-throughput"
                                        and bounds[group] <= best[1].tokens_per_s):
                break
            found = self._group(profile, int(group), False, allowed, int(group) in touched)
            if found is None:
                continue
            best_any = max(best_any, found[1].tokens_per_s)
            if found[1].tokens_per_s >= need and (
                    best is None or (found[1].tokens_per_s > best[1].tokens_per_s) == (self.config.choice == "most-throughput")):
                best = found
        if best is not None:
            return Placement(job.job_id, tuple(self.snapshot.device_ids[i] for i in best[0]), best[1])
        fits_if_free = False
        whole_bounds = self._upper_bounds(profile, allowed)
        for group in np.argsort(-whole_bounds, kind="stable"):
            if whole_bounds[group] < need:
                break
            found = self._group(profile, int(group), True, allowed, int(group) in touched)
            if found is not None:
                best_any = max(best_any, found[1].tokens_per_s)
                if found[1].tokens_per_s >= need:
                    fits_if_free = True
                    break
        if not fits_if_free and best_any == 0.0:
            best_any = float(max(whole_bounds.max(initial=0.0), 0.0))   # nothing evaluated: the bound says it all
        return self._reject(job, best_any, fits_if_free)

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
