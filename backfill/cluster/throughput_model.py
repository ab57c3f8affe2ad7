"""Valve §6: the effective throughput of an offline job on a harvested node.

    T_eff(w, n) = T_mono(w) x C_n x M(w, n) x A(w, n)

    C_n      idle compute fraction: the share of the observation window in which the node's online
             work left its devices idle (the colocation runtime's measured timeslices for offline).
    M(w, n)  memory factor: the job's throughput-vs-memory curve f_w averaged over the node's
             free-memory trace m_n(t), relative to f_w at full memory, less a job-specific loss
             coefficient beta_w times the expected deficit below the job's required memory R_w:
                 M = mean_t f_w(m_n(t)) / f_w(inf) - beta_w x mean_t max(0, R_w - m_n(t)) / R_w
             clipped to [0, 1].
    A(w, n)  alignment of busy periods for a job that runs in lockstep on k devices: it can only
             step when all k devices are idle, so A = (time all k are idle) / (mean idle time of
             the k). Admission also needs every pairwise score overlap / union of busy time to
             reach a threshold (Valve: misaligned online services make lockstep stragglers).

Everything here is plain numpy over a ClusterSnapshot, so the same model serves the Ray cluster,
tests on constructed states and the fleet simulator (which evaluates it for thousands of devices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backfill.errors import ClusterInputError


@dataclass(frozen=True)
class JobProfile:
    """What a job's one-off profile at submission gives (Valve §6)."""

    tokens_per_s_mono: float                  # T_mono: alone on a monopolised device, full memory
    memory_gb: tuple[float, ...] = (1.0,)     # the curve f_w: throughput share at each memory size
    memory_share: tuple[float, ...] = (1.0,)  #   (linear in between, flat past the last point)
    required_memory_gb: float = 0.0           # R_w: below it the job must shrink
    deficit_loss: float = 0.0                 # beta_w: throughput lost per unit of relative deficit
    devices: int = 1                          # k: devices it runs on in lockstep (model parallel)

    def __post_init__(self) -> None:
        if not (self.tokens_per_s_mono > 0 and np.isfinite(self.tokens_per_s_mono)):
            raise ClusterInputError(f"tokens_per_s_mono must be a positive number, got {self.tokens_per_s_mono}")
        if len(self.memory_gb) != len(self.memory_share) or not self.memory_gb:
            raise ClusterInputError("memory_gb and memory_share must be non-empty and of the same length")
        if any(b <= a for a, b in zip(self.memory_gb, self.memory_gb[1:])) or self.memory_gb[0] < 0:
            raise ClusterInputError(f"memory_gb must be >= 0 and strictly increasing, got {self.memory_gb}")
        if any(not 0 <= s <= 1 for s in self.memory_share) or self.memory_share[-1] <= 0:
            raise ClusterInputError(f"memory_share must lie in [0, 1] and end above 0, got {self.memory_share}")
        if self.required_memory_gb < 0 or self.deficit_loss < 0:
            raise ClusterInputError("required_memory_gb and deficit_loss must be >= 0")
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ClusterInputError(f"devices must be an integer >= 1, got {self.devices!r}")

    def share_at(self, free_gb: np.ndarray) -> np.ndarray:
        """f_w(m) / f_w(inf): the curve at each free-memory sample (0 below its first point)."""
        share = np.interp(free_gb, self.memory_gb, self.memory_share, left=0.0, right=self.memory_share[-1])
        return share / self.memory_share[-1]


@dataclass(frozen=True)
class OfflineJob:
    job_id: str
    profile: JobProfile
    sla_tokens_per_s: float                   # the throughput the job was promised

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ClusterInputError("job_id must be a non-empty string")
        if not (self.sla_tokens_per_s > 0 and np.isfinite(self.sla_tokens_per_s)):
            raise ClusterInputError(f"sla_tokens_per_s must be a positive number, got {self.sla_tokens_per_s}")


@dataclass
class ClusterSnapshot:
    """The cluster over the last observation window: D devices, T samples each.

    busy[d, t] is True where device d's online work was busy at sample t; the idle compute
    fraction is measured separately by each runtime (its samples may be finer than T)."""

    device_ids: list[str]
    node_of: np.ndarray            # (D,) int: the machine each device is in (lockstep jobs stay in one)
    idle_fraction: np.ndarray      # (D,) float in [0, 1]: C_n
    free_memory_gb: np.ndarray     # (D, T) float: m_n(t)
    busy: np.ndarray               # (D, T) bool
    occupied: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # (D,) hosts a job

    def __post_init__(self) -> None:
        d = len(self.device_ids)
        self.node_of = np.asarray(self.node_of, dtype=np.int64)
        self.idle_fraction = np.asarray(self.idle_fraction, dtype=np.float64)
        self.free_memory_gb = np.atleast_2d(np.asarray(self.free_memory_gb, dtype=np.float64))
        self.busy = np.atleast_2d(np.asarray(self.busy, dtype=bool))
        if self.occupied.size == 0:
            self.occupied = np.zeros(d, dtype=bool)
        self.occupied = np.asarray(self.occupied, dtype=bool)
        if len(set(self.device_ids)) != d:
            raise ClusterInputError("device_ids must be unique")
        for name in ("node_of", "idle_fraction", "occupied"):
            if getattr(self, name).shape != (d,):
                raise ClusterInputError(f"{name} must have one entry per device ({d}), got {getattr(self, name).shape}")
        for name in ("free_memory_gb", "busy"):
            arr = getattr(self, name)
            if arr.ndim != 2 or arr.shape[0] != d or arr.shape[1] < 1:
                raise ClusterInputError(f"{name} must be (devices={d}, samples>=1), got {arr.shape}")
        if np.any((self.idle_fraction < 0) | (self.idle_fraction > 1)) or not np.all(np.isfinite(self.idle_fraction)):
            raise ClusterInputError("idle_fraction must lie in [0, 1]")

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)


def compute_factor(snapshot: ClusterSnapshot) -> np.ndarray:
    """C_n per device."""
    return snapshot.idle_fraction


def memory_factor(profile: JobProfile, free_memory_gb: np.ndarray) -> np.ndarray:
    """M(w, n) per device (rows of free_memory_gb), Valve §6 eq. 2."""
    average_share = profile.share_at(free_memory_gb).mean(axis=-1)
    if profile.required_memory_gb > 0:
        deficit = np.maximum(0.0, profile.required_memory_gb - free_memory_gb).mean(axis=-1)
        average_share = average_share - profile.deficit_loss * deficit / profile.required_memory_gb
    return np.clip(average_share, 0.0, 1.0)


def pairwise_alignment(busy: np.ndarray) -> np.ndarray:
    """(..., k, k) scores overlap / union of busy time for busy traces (..., k, T); 1 where both never busy."""
    b = busy.astype(np.float32)
    overlap = b @ np.swapaxes(b, -1, -2)
    per_device = b.sum(axis=-1)
    union = per_device[..., :, None] + per_device[..., None, :] - overlap
    return np.where(union > 0, overlap / np.maximum(union, 1e-12), 1.0)


def alignment_factor(busy: np.ndarray, idle_fraction: np.ndarray) -> float:
    """A(w, n) for a lockstep job on devices with busy traces (k, T) and idle fractions (k,)."""
    if busy.shape[0] <= 1:
        return 1.0
    all_idle = float((~busy.any(axis=0)).mean())
    mean_idle = float((~busy).mean())
    if mean_idle <= 0:
        return 0.0
    return min(1.0, all_idle / mean_idle)


@dataclass(frozen=True)
class Prediction:
    tokens_per_s: float
    compute: float       # C_n (mean over the job's devices)
    memory: float        # M (the worst of its devices: a lockstep job runs at its slowest)
    alignment: float     # A
    min_pair_score: float  # the lowest pairwise busy-alignment score (1 for one device)

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "compute": self.compute, "memory": self.memory,
                "alignment": self.alignment, "min_pair_score": self.min_pair_score}


def predict(profile: JobProfile, snapshot: ClusterSnapshot, devices: list[int] | np.ndarray) -> Prediction:
    """T_eff of the job on these devices (one for a single-device job, k for a lockstep job)."""
    devices = np.asarray(devices, dtype=np.int64)
    if devices.size != profile.devices:
        raise ClusterInputError(f"the job runs on {profile.devices} device(s), got {devices.size}")
    compute = float(compute_factor(snapshot)[devices].mean())
    memory = float(memory_factor(profile, snapshot.free_memory_gb[devices]).min())
    busy = snapshot.busy[devices]
    alignment = alignment_factor(busy, snapshot.idle_fraction[devices])
    scores = pairwise_alignment(busy)
    min_pair = float(scores[np.triu_indices(devices.size, 1)].min()) if devices.size > 1 else 1.0
    return Prediction(profile.tokens_per_s_mono * compute * memory * alignment, compute, memory, alignment, min_pair)
