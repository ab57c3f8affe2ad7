"""Fleet simulator (Valve §6-§7): the real ClusterController (scheduler, throughput model, SLA
monitor) deciding for thousands of simulated devices, one second per step, in numpy.

Online load, per service (a service spans 1, 2, 4 or 8 devices of one machine):
    L(t) = clip(base x (1 + amplitude x sin(2 pi (hour(t) - peak_hour) / 24)) + bursts(t), 0, 0.97)
    base ~ U(base_load), peak_hour = 14 + U(-2, 2); bursts arrive as a Poisson process
    (burst_rate_per_hour), last Exp(burst_mean_s) and add burst_height.
    Busy periods: a two-state Markov chain per service with mean busy period busy_period_s and
    stationary busy share L(t); devices of an aligned service share it, those of a misaligned one
    (misaligned_share of multi-device services: Valve saw 32% partly overlapping) run their own.
    Free memory: device_memory_gb - weights - kv_gb x (L + busy) / 2 - |N(0, 1)| GB.
Offline jobs: a backlog of jobs from JOB_KINDS (profile, SLA share of T_mono, work in seconds of
SLA throughput); a job progresses T_mono x share(free memory) per second in which all its devices
are idle, and leaves when its work is done. Every interval_s the controller sees the last
window_s of traces and each running job's throughput since the last round.

Reports per placer: utilisation gain (share of device time computing offline), offline throughput
delivered against SLA, evictions, rejections, and devices saved (Valve §7.1: sum over jobs of
delivered throughput / standalone throughput x devices).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from backfill.cluster.controller import ClusterController, RoundResult
from backfill.cluster.monitor import MonitorConfig, SLAMonitor
from backfill.cluster.job_scheduler import ClusterScheduler, Placement, Rejection, ClusterSchedulerConfig
from backfill.cluster.throughput_model import ClusterSnapshot, JobProfile, OfflineJob, predict
from backfill.errors import ClusterInputError

PLACERS = ("valve", "most-idle", "random")


@dataclass(frozen=True)
class JobKind:
    name: str
    profile: JobProfile
    sla_share: tuple[float, float]     # SLA = U(sla_share) x T_mono
    weight: float                      # share of the backlog


JOB_KINDS = (
    JobKind("chat-1b", JobProfile(2000.0, (0.0, 4.0, 12.0), (0.0, 0.5, 1.0), 4.0, 1.0, 1), (0.25, 0.7), 0.45),
    JobKind("summarise-8b", JobProfile(1200.0, (0.0, 10.0, 30.0), (0.0, 0.6, 1.0), 10.0, 0.5, 1), (0.25, 0.65), 0.35),
    JobKind("batch-70b-tp2", JobProfile(500.0, (0.0, 15.0, 30.0), (0.0, 0.5, 1.0), 15.0, 0.5, 2), (0.15, 0.5), 0.15),
    JobKind("batch-70b-tp4", JobProfile(800.0, (0.0, 10.0, 20.0), (0.0, 0.5, 1.0), 10.0, 0.5, 4), (0.15, 0.45), 0.05),
)
SERVICE_LAYOUTS = ((8,), (4, 4), (2, 2, 2, 2), (4, 2, 1, 1), (1,) * 8, (2, 2, 1, 1, 1, 1))


@dataclass(frozen=True)
class FleetConfig:
    devices: int = 8054
    gpus_per_machine: int = 8
    duration_s: int = 3600
    window_s: int = 300               # the observation window the throughput model sees
    interval_s: int = 60              # scheduling and SLA-monitor period
    start_hour: float = 9.0           # the simulated hour starts here (the morning ramp of the diurnal load)
    base_load: tuple[float, float] = (0.15, 0.6)
    diurnal_amplitude: float = 0.35
    burst_rate_per_hour: float = 1.0
    burst_mean_s: float = 120.0
    burst_height: float = 0.35
    busy_period_s: float = 4.0
    misaligned_share: float = 0.32
    device_memory_gb: float = 80.0
    jobs_per_device: float = 0.9      # backlog: offline demand in devices, relative to the fleet
    job_work_s: tuple[float, float] = (600.0, 5400.0)   # work per job, in seconds at its SLA throughput
    infeasible_share: float = 0.02    # jobs asking for nearly T_mono: no harvested device can serve them
    seed: int = 0

    def __post_init__(self) -> None:
        if self.devices < 1 or self.gpus_per_machine < 1 or self.duration_s < self.interval_s:
            raise ClusterInputError("devices and gpus_per_machine must be >= 1 and duration_s >= interval_s")
        if self.window_s < 1 or self.interval_s < 1:
            raise ClusterInputError("window_s and interval_s must be >= 1")


@dataclass
class PlacerReport:
    placer: str
    online_busy_share: float = 0.0       # device time busy with online work
    offline_compute_share: float = 0.0   # device time computing offline work (the utilisation gain)
    utilisation_gain_pct: float = 0.0    # offline compute share in percentage points of device time
    offline_tokens: float = 0.0
    sla_tokens: float = 0.0              # what running jobs were promised over the time they ran
    delivered_vs_sla: float = 0.0
    checks_meeting_sla: float = 0.0      # monitor checks at or above tolerance x SLA
    jobs_submitted: int = 0
    jobs_placed: int = 0
    jobs_finished: int = 0
    jobs_rejected: int = 0
    evictions: int = 0
    devices_saved: float = 0.0
    decide_s: float = 0.0                # wall time in the controller
    wall_s: float = 0.0


# --- naive placers: the same interface as ClusterScheduler, no throughput model ----------------------

class NaivePlacer:
    """Most-idle-first or random: any free device(s) of one machine, SLA and alignment ignored."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        if kind not in ("most-idle", "random"):
            raise ClusterInputError(f"naive placer must be most-idle or random, got {kind!r}")
        self.kind = kind
        self.rng = np.random.default_rng(seed)

    def session(self, snapshot: ClusterSnapshot, exclude: dict[str, set[str]] | None = None) -> "_NaiveSession":
        return _NaiveSession(self, snapshot, exclude or {})


class _NaiveSession:
    def __init__(self, placer: NaivePlacer, snapshot: ClusterSnapshot, exclude: dict[str, set[str]]) -> None:
        self.placer, self.snapshot, self.exclude = placer, snapshot, exclude
        self.free = ~snapshot.occupied.copy()
        self.order = np.argsort(-snapshot.idle_fraction, kind="stable")

    def place(self, job: OfflineJob) -> Placement | Rejection:
        s, k = self.snapshot, job.profile.devices
        banned = self.exclude.get(job.job_id, set())
        usable = self.free & np.array([d not in banned for d in s.device_ids]) if banned else self.free
        machines = s.node_of
        if k == 1:
            candidates = self.order[usable[self.order]]
            if self.placer.kind == "random" and candidates.size:
                candidates = candidates[self.placer.rng.integers(candidates.size):]
            chosen = candidates[:1]
        else:
            counts = np.bincount(machines[usable], minlength=machines.max() + 1)
            ok = np.flatnonzero(counts >= k)
            if ok.size == 0:
                chosen = np.array([], dtype=np.int64)
            else:
                if self.placer.kind == "random":
                    machine = ok[self.placer.rng.integers(ok.size)]
                else:
                    idle = np.bincount(machines, weights=s.idle_fraction * usable, minlength=counts.size)
                    machine = ok[np.argmax(idle[ok] / counts[ok])]
                on = self.order[(machines[self.order] == machine) & usable[self.order]]
                chosen = np.sort(on[:k])
        if chosen.size < k:
            return Rejection(job.job_id, "no free device", 0.0, permanent=False)
        self.free[chosen] = False
        return Placement(job.job_id, tuple(s.device_ids[i] for i in chosen), predict(job.profile, s, chosen))


# --- the fleet ------------------------------------------------------------------------------------------

@dataclass
class _Services:
    device_service: np.ndarray     # (D,) service index of each device
    aligned: np.ndarray            # (S,) bool
    base: np.ndarray               # (S,)
    peak_hour: np.ndarray          # (S,)
    weights_gb: np.ndarray         # (S,)
    kv_gb: np.ndarray              # (S,)
    burst_left_s: np.ndarray       # (S,) seconds of burst still to run


class Fleet:
    """Online load and memory of every device, one second at a time."""

    def __init__(self, cfg: FleetConfig, rng: np.random.Generator) -> None:
        self.cfg, self.rng = cfg, rng
        d = cfg.devices
        self.node_of = np.arange(d) // cfg.gpus_per_machine
        service_of = np.empty(d, dtype=np.int64)
        sizes: list[int] = []
        for machine in range(int(self.node_of[-1]) + 1):
            first = machine * cfg.gpus_per_machine
            count = min(cfg.gpus_per_machine, d - first)
            layout = SERVICE_LAYOUTS[rng.integers(len(SERVICE_LAYOUTS))] if count == cfg.gpus_per_machine else (1,) * count
            offset = first
            for size in layout:
                service_of[offset:offset + size] = len(sizes)
                sizes.append(size)
                offset += size
        n = len(sizes)
        sizes_arr = np.array(sizes)
        self.services = _Services(
            service_of, (sizes_arr == 1) | (rng.random(n) >= cfg.misaligned_share), rng.uniform(*cfg.base_load, n),
            14.0 + rng.uniform(-2, 2, n), rng.uniform(20, 45, n), rng.uniform(8, 25, n), np.zeros(n))
        self.service_busy = rng.random(n) < self.services.base
        self.device_busy = self.service_busy[service_of].copy()

    def load(self, t_s: float) -> np.ndarray:
        cfg, sv = self.cfg, self.services
        hour = cfg.start_hour + t_s / 3600.0
        load = sv.base * (1 + cfg.diurnal_amplitude * np.sin(2 * np.pi * (hour - sv.peak_hour + 6) / 24))
        starts = self.rng.random(load.size) < cfg.burst_rate_per_hour / 3600.0
        sv.burst_left_s[starts] = self.rng.exponential(cfg.burst_mean_s, int(starts.sum()))
        load = load + cfg.burst_height * (sv.burst_left_s > 0)
        sv.burst_left_s = np.maximum(0.0, sv.burst_left_s - 1.0)
        return np.clip(load, 0.0, 0.97)

    def step(self, t_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(busy (D,) bool, free memory (D,) GB) for second t_s."""
        sv, cfg = self.services, self.cfg
        load = self.load(t_s)
        leave = 1.0 / cfg.busy_period_s                       # busy -> idle per second
        enter = np.minimum(1.0, load / np.maximum(1 - load, 1e-3) * leave)   # keeps the busy share at load
        flip_service = self.rng.random(load.size)
        self.service_busy = np.where(self.service_busy, flip_service >= leave, flip_service < enter)
        device_load = load[sv.device_service]
        flip_device = self.rng.random(device_load.size)
        own = np.where(self.device_busy, flip_device >= leave,
                       flip_device < np.minimum(1.0, device_load / np.maximum(1 - device_load, 1e-3) * leave))
        self.device_busy = np.where(sv.aligned[sv.device_service], self.service_busy[sv.device_service], own)
        used = (sv.weights_gb + sv.kv_gb * load / 2)[sv.device_service] + sv.kv_gb[sv.device_service] * self.device_busy / 2
        free = cfg.device_memory_gb - used - np.abs(self.rng.normal(0.0, 1.0, device_load.size))
        return self.device_busy.copy(), free


def make_jobs(cfg: FleetConfig, rng: np.random.Generator) -> tuple[list[OfflineJob], dict[str, float]]:
    """The backlog and each job's work in tokens."""
    weights = np.array([k.weight for k in JOB_KINDS])
    demand = cfg.jobs_per_device * cfg.devices
    jobs: list[OfflineJob] = []
    work: dict[str, float] = {}
    used = 0.0
    while used < demand:
        kind = JOB_KINDS[rng.choice(len(JOB_KINDS), p=weights / weights.sum())]
        t_mono = kind.profile.tokens_per_s_mono
        share = 0.97 if rng.random() < cfg.infeasible_share else rng.uniform(*kind.sla_share)
        job = OfflineJob(f"{kind.name}-{len(jobs)}", kind.profile, round(share * t_mono, 1))
        jobs.append(job)
        work[job.job_id] = job.sla_tokens_per_s * rng.uniform(*cfg.job_work_s)
        used += kind.profile.devices
    return jobs, work


@dataclass
class RoundRecord:
    """What one decision round saw and decided (to replay through another controller)."""

    snapshot: ClusterSnapshot
    measured: dict[str, float]
    finished: list[str]
    decisions: list[tuple]


def make_controller(placer: str, seed: int = 0) -> ClusterController:
    monitor = SLAMonitor(MonitorConfig())
    if placer == "valve":
        return ClusterController(ClusterScheduler(ClusterSchedulerConfig()), monitor)
    if placer in PLACERS:
        return ClusterController(NaivePlacer(placer, seed), monitor)
    raise ClusterInputError(f"placer must be one of {PLACERS}, got {placer!r}")


def simulate(cfg: FleetConfig, placer: str = "valve", record: list[RoundRecord] | None = None,
             controller: ClusterController | None = None) -> PlacerReport:
    """One simulated run; every placer sees the same online traces and backlog (same seed)."""
    started = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    fleet = Fleet(cfg, rng)
    jobs, work_tokens = make_jobs(cfg, np.random.default_rng(cfg.seed + 1))
    controller = controller or make_controller(placer, cfg.seed)
    for job in jobs:
        controller.submit(job)
    report = PlacerReport(placer, jobs_submitted=len(jobs))
    d, w = cfg.devices, cfg.window_s
    device_ids = [f"dev{i}" for i in range(d)]
    index = {dev: i for i, dev in enumerate(device_ids)}
    busy_hist = np.zeros((d, w), dtype=bool)
    free_hist = np.zeros((d, w), dtype=np.float32)
    for t in range(-w, 0):                                     # warm-up: fill the observation window
        busy, free = fleet.step(t)
        busy_hist[:, t % w], free_hist[:, t % w] = busy, free
    job_by_id = {j.job_id: j for j in jobs}
    number = {j.job_id: i for i, j in enumerate(jobs)}
    work_left = np.array([work_tokens[j.job_id] for j in jobs])
    delivered_interval = np.zeros(len(jobs))
    delivered_total = np.zeros(len(jobs))
    running_s = np.zeros(len(jobs))
    placed_ever: set[str] = set()
    finished: list[str] = []
    checks = meeting = 0
    busy_sum = offline_sum = 0.0
    layout = _Layout.empty()
    for t in range(cfg.duration_s):
        if t % cfg.interval_s == 0:
            snapshot = ClusterSnapshot(device_ids, fleet.node_of, 1.0 - busy_hist.mean(axis=1), free_hist, busy_hist)
            measured = {j: float(delivered_interval[number[j]]) / cfg.interval_s for j in layout.jobs
                        if j in controller.running}
            for job_id, tps in measured.items():
                checks += 1
                meeting += tps >= controller.monitor.config.tolerance * job_by_id[job_id].sla_tokens_per_s
            t0 = time.perf_counter()
            result = controller.step(snapshot, measured)
            report.decide_s += time.perf_counter() - t0
            if record is not None:
                record.append(RoundRecord(snapshot, measured, finished, result.decisions()))
            finished = []
            report.jobs_rejected += len(result.rejected)
            placed_ever.update(p.job_id for p in result.placed)
            delivered_interval[:] = 0.0
            layout = _Layout.build(controller.running, job_by_id, index, number)
        busy, free = fleet.step(t)
        busy_hist[:, t % w], free_hist[:, t % w] = busy, free
        busy_sum += busy.mean()
        if layout.jobs:
            idx = layout.numbers
            tokens = layout.progress(busy, free)
            delivered_interval[idx] += tokens
            delivered_total[idx] += tokens
            work_left[idx] -= tokens
            running_s[idx] += 1.0
            offline_sum += float(layout.devices_per_job[tokens > 0].sum()) / d
            done = idx[work_left[idx] <= 0]
            if done.size:
                for i in done:
                    controller.finish(jobs[i].job_id)
                    finished.append(jobs[i].job_id)
                layout = _Layout.build(controller.running, job_by_id, index, number)
    report.online_busy_share = busy_sum / cfg.duration_s
    report.offline_compute_share = offline_sum / cfg.duration_s
    report.utilisation_gain_pct = 100.0 * report.offline_compute_share
    report.offline_tokens = float(delivered_total.sum())
    report.sla_tokens = float(sum(j.sla_tokens_per_s * running_s[i] for i, j in enumerate(jobs)))
    report.delivered_vs_sla = report.offline_tokens / report.sla_tokens if report.sla_tokens else 0.0
    report.checks_meeting_sla = meeting / checks if checks else 0.0
    report.jobs_placed = len(placed_ever)
    report.jobs_finished = int((work_left <= 0).sum())
    report.evictions = controller.evictions
    report.devices_saved = float(sum(delivered_total[i] / cfg.duration_s / j.profile.tokens_per_s_mono * j.profile.devices
                                     for i, j in enumerate(jobs)))
    report.wall_s = time.perf_counter() - started
    return report


@dataclass
class _Layout:
    """Running jobs as flat arrays, rebuilt when placements change, so a step is a few numpy calls."""

    jobs: list[str] = field(default_factory=list)
    numbers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))   # jobs' simulator numbers
    devices_per_job: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    flat_devices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    t_mono: np.ndarray = field(default_factory=lambda: np.zeros(0))
    by_profile: list[tuple[JobProfile, np.ndarray]] = field(default_factory=list)   # rows of flat_devices

    @classmethod
    def empty(cls) -> "_Layout":
        return cls()

    @classmethod
    def build(cls, running: dict[str, Placement], jobs: dict[str, OfflineJob], index: dict[str, int],
              number: dict[str, int]) -> "_Layout":
        ids = sorted(running)
        per = np.array([len(running[j].device_ids) for j in ids], dtype=np.int64)
        flat = np.array([index[dev] for j in ids for dev in running[j].device_ids], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64) if ids else np.zeros(0, np.int64)
        rows: dict[JobProfile, list[int]] = {}
        for j, start, k in zip(ids, starts, per):
            rows.setdefault(jobs[j].profile, []).extend(range(start, start + k))
        return cls(ids, np.array([number[j] for j in ids], dtype=np.int64), per, flat, starts, np.array([jobs[j].profile.tokens_per_s_mono for j in ids]),
                   [(p, np.array(r)) for p, r in rows.items()])

    def progress(self, busy: np.ndarray, free: np.ndarray) -> np.ndarray:
        """Tokens each job makes this second: T_mono x the worst memory share, if all its devices are idle."""
        share = np.empty(self.flat_devices.size)
        free_here = free[self.flat_devices]
        for profile, rows in self.by_profile:
            s = profile.share_at(free_here[rows])
            if profile.required_memory_gb > 0:
                s = s - profile.deficit_loss * np.maximum(0.0, profile.required_memory_gb - free_here[rows]) \
                    / profile.required_memory_gb
            share[rows] = np.clip(s, 0.0, 1.0)
        share = np.where(busy[self.flat_devices], 0.0, share)
        return self.t_mono * np.minimum.reduceat(share, self.starts)


def run_fleet(cfg: FleetConfig, placers: tuple[str, ...] = ("valve", "most-idle")) -> dict:
    reports = [simulate(cfg, placer) for placer in placers]
    return {"config": asdict(cfg), "reports": [asdict(r) for r in reports]}
