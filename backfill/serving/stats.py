"""What the scheduler counts: steps, aborts, preemptions, checkpoint traffic, per-mode time.

Benchmarks read these to say where online latency went and what offline work cost; nothing in
the scheduler decides from them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class PreemptionRecord(NamedTuple):
    """An offline step yielding to an online arrival (ConServe §4.3), with where the time went."""

    at_s: float             # monotonic time the step yielded
    latency_ms: float       # from the online arrival to the yield
    flag_ms: float          # from the arrival to the abort flag being set (the rest: finishing a layer)
    layer: int | None       # safepoint the step stopped at; None: it ran to its end (only the LM head was left)
    step_tokens: int        # tokens in the step that yielded


class StepRecord(NamedTuple):
    """One scheduler step, for finding where online latency went (the last few thousand are kept)."""

    at_s: float             # monotonic time the step started
    mode: str               # the plan's mode (co-serving, offline-batching, ...)
    online_tokens: int
    offline_tokens: int
    busy_ms: float          # the whole step: restores, the forward pass, sampling, checkpoints
    forward_ms: float       # the model's forward pass alone (to an abort, if aborted)
    aborted: bool


PREEMPTION_LATENCY_BOUNDS_MS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
KEPT_EVENTS = 20_000    # the newest preemptions kept for benchmarks; older ones live on in the histogram


@dataclass
class CumulativeHistogram:
    """Counts per upper bound, updated as values arrive: bounded memory however long the server runs."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bound, not cumulative; one more for +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def cumulative(self) -> list[int]:
        """The count at or below each bound, +Inf last (Prometheus' le buckets)."""
        out, running = [], 0
        for count in list(self.counts):
            running += count
            out.append(running)
        return out


class StepMark(NamedTuple):
    offline_tokens: int
    forward_s: float
    aborted_steps: int


@dataclass
class SchedulerStats:
    steps: int = 0
    aborted_steps: int = 0
    resumed_steps: int = 0              # aborted steps continued from their safepoint
    wasted_tokens: int = 0              # tokens of aborted steps that were redone instead
    wasted_forward_s: float = 0.0       # forward time those aborted steps had run
    preemption_events: deque[PreemptionRecord] = field(default_factory=lambda: deque(maxlen=KEPT_EVENTS))
    preemption_latency_ms: CumulativeHistogram = field(
        default_factory=lambda: CumulativeHistogram(PREEMPTION_LATENCY_BOUNDS_MS))
    preempted_requests: int = 0         # requests taken off the device to free blocks
    checkpointed_tokens: int = 0
    checkpoint_bytes: int = 0
    restored_tokens: int = 0
    recomputed_tokens: int = 0
    # Prefix caching, in prompt tokens as vLLM counts them, per class: looked up at a request's
    # first schedule, and found cached there.
    prefix_cache_queries: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    prefix_cache_hits: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    output_tokens: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    finished: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    last_step_mode: str = "idle"
    busy_s: float = 0.0                 # in forward passes (runner.execute), aborted ones included
    # Steps that carried online tokens, whole (Valve §6: what online leaves idle is the rest).
    online_busy_s: float = 0.0
    # Per plan mode (co-serving, offline-batching, priority, ...): step time, checkpoint and
    # restore copies included, and the offline tokens its steps produced.
    mode_busy_s: dict[str, float] = field(default_factory=dict)
    mode_offline_tokens: dict[str, int] = field(default_factory=dict)
    step_log: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=20_000))

    @property
    def preemption_latencies_ms(self) -> list[float]:
        return [event.latency_ms for event in self.preemption_events]

    def record_preemption(self, event: PreemptionRecord) -> None:
        self.preemption_events.append(event)
        self.preemption_latency_ms.observe(event.latency_ms)

    def mark(self) -> StepMark:
        """The counters a step moves, read before it runs (see count_step)."""
        return StepMark(self.output_tokens["offline"], self.busy_s, self.aborted_steps)

    def count_step(self, mode: str, started_s: float, busy_s: float, online_tokens: int, fed_tokens: int,
                   before: StepMark) -> None:
        """Charge one finished scheduler step, begun at `before`, to its plan's mode and log it."""
        self.mode_busy_s[mode] = self.mode_busy_s.get(mode, 0.0) + busy_s
        if online_tokens:
            self.online_busy_s += busy_s
        self.mode_offline_tokens[mode] = (self.mode_offline_tokens.get(mode, 0)
                                          + self.output_tokens["offline"] - before.offline_tokens)
        self.step_log.append(StepRecord(started_s, mode, online_tokens, fed_tokens - online_tokens, busy_s * 1e3,
                                        (self.busy_s - before.forward_s) * 1e3, self.aborted_steps > before.aborted_steps))
