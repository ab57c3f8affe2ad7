"""The REEF scheduler's configuration and the benchmark's presets, kept free of torch so that
`backfill bench disb --help` builds its parser without loading a framework."""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import RealtimeError

MODES = ("reef", "seq", "concurrent", "rt-only")
PREEMPT_PATHS = ("evict", "kill", "auto")
DEEP_QUEUE = 1024  # seq / concurrent launch a whole request at once, as streams without a cap do


@dataclass(frozen=True)
class TaskSchedulerConfig:
    mode: str = "reef"
    inflight_capacity: int = 4       # REEF §4.2: the device queue is capped at 4
    preempt_path: str = "evict"      # evict (wait for the running op), kill (abort it), auto (wait briefly, then kill);
                                     # evict by default on a CPU: a kill costs a fork, tens of ms (docs/realtime.md)
    evict_wait_ms: float = 1.0       # auto: wait this long at most for the running op, else kill it
    pad: bool = False                # §5: BE streams keep the cores an RT op leaves idle
    cores: int = 2
    rt_threads: int = 1
    busy_poll: bool = False          # spin instead of sleeping on the progress semaphore
    spin_ms: float = 1.0             # spin (not sleep) this long before the next RT arrival
    be_nice: int = 5                 # reef: BE workers this many nice levels below the scheduler, so the
                                     # OS runs the scheduler first when an RT request arrives (stream priority)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RealtimeError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.preempt_path not in PREEMPT_PATHS:
            raise RealtimeError(f"preempt_path must be one of {PREEMPT_PATHS}, got {self.preempt_path!r}")
        if not 1 <= self.inflight_capacity <= DEEP_QUEUE:
            raise RealtimeError(f"inflight_capacity must be in 1..{DEEP_QUEUE}, got {self.inflight_capacity}")
        if self.evict_wait_ms < 0:
            raise RealtimeError("evict_wait_ms must be >= 0")
        if self.spin_ms < 0:
            raise RealtimeError("spin_ms must be >= 0")
        if not 0 <= self.be_nice <= 19:
            raise RealtimeError(f"be_nice must be in 0..19, got {self.be_nice}")
        if not 1 <= self.rt_threads <= self.cores:
            raise RealtimeError(f"rt_threads must be in 1..cores ({self.cores}), got {self.rt_threads}")


ALL_MODELS = ("resnet152", "vgg19", "bert", "gpt2", "llm")
# Variants of the scheduler a DISB run compares; "reef-pad" is REEF with §5 padding.
MODE_CONFIGS = {
    "rt-only": TaskSchedulerConfig(mode="rt-only"),
    "seq": TaskSchedulerConfig(mode="seq"),
    "concurrent": TaskSchedulerConfig(mode="concurrent"),
    "reef": TaskSchedulerConfig(mode="reef", preempt_path="kill"),
    # §5 on a CPU: padded streams' queues are deeper because the scheduler tops them up only between
    # RT ops (their ops are never evicted).
    "reef-pad": TaskSchedulerConfig(mode="reef", pad=True, preempt_path="kill", inflight_capacity=64),
    # The other preemption paths: wait for the running op (no kill, so no restore), or wait only
    # for an op about to end.
    "reef-evict": TaskSchedulerConfig(mode="reef", preempt_path="evict"),
    "reef-auto": TaskSchedulerConfig(mode="reef", preempt_path="auto"),
    "reef-pad-evict": TaskSchedulerConfig(mode="reef", pad=True, preempt_path="evict", inflight_capacity=64),
}
# Model sizes (width scale) for the benchmark: a CPU inference of milliseconds to tens of ms.
DISB_SCALES = {"resnet152": 0.5, "vgg19": 0.5, "bert": 0.25, "gpt2": 0.25, "llm": 1.0}
TINY_SCALES = {"resnet152": 0.125, "vgg19": 0.125, "bert": 0.0625, "gpt2": 0.0625, "llm": 0.5}
