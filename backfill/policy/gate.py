"""Compute gates: when may offline engines run next to an online engine (Valve §4.2).

A gate is a pure state machine. The caller feeds it timestamped events (online busy / idle,
online decode steps, offline iteration boundaries) and asks `decide(now_s)`; nothing here reads
a clock, so the node runtime and the simulator drive the same objects.

    LifecycleGate  Valve: close the moment online turns busy; reopen only after online stayed
                   idle for a cooldown of 2x the longest gap between its decode steps, so the
                   short idle gaps between decode iterations never wake offline work and each
                   online request is preempted at most once.
    TimesliceGate  GPreempt-style baseline: reopen as soon as online is idle, so offline wakes
                   in every decode gap and is preempted again at the next step.
    IterationGate  iteration-level baseline (kernel preemption under CUDA graphs, vLLM++): a
                   close request only takes effect at the next offline iteration boundary;
                   reopen as soon as online is idle.

Preemptions are counted per online request: each OPEN -> CLOSED transition is charged to the
requests of the busy report that caused it (requests arriving while already closed are not
disturbed and stay at 0).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from backfill.errors import PolicyInputError


class GateState(str, enum.Enum):
    OPEN = "open"      # offline may run
    CLOSED = "closed"  # offline paused


@dataclass(frozen=True)
class GateDecision:
    open: bool
    # When closed and online is idle: the time the gate will reopen if nothing else happens.
    reopen_at_s: float | None = None


@dataclass(frozen=True)
class GateConfig:
    # Valve §4.2: cooldown = 2x the longest decode gap, measured at run time.
    cooldown_factor: float = 2.0
    # Cooldown before any gap was measured, and its lower bound afterwards.
    min_cooldown_s: float = 0.05
    # Upper bound, so one long stall (e.g. a swap) cannot keep offline out for long.
    max_cooldown_s: float = 2.0
    # The longest gap is taken over this many most recent gaps, so the cooldown can shrink
    # again after a slow phase.
    gap_window: int = 512

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cooldown_factor) and self.cooldown_factor >= 1.0):
            raise PolicyInputError(f"cooldown_factor must be >= 1, got {self.cooldown_factor}")
        if not (0.0 <= self.min_cooldown_s <= self.max_cooldown_s and math.isfinite(self.max_cooldown_s)):
            raise PolicyInputError("need 0 <= min_cooldown_s <= max_cooldown_s < inf, got "
                                   f"{self.min_cooldown_s}, {self.max_cooldown_s}")
        if self.gap_window < 1:
            raise PolicyInputError(f"gap_window must be >= 1, got {self.gap_window}")


@dataclass
class GateStats:
    pauses: int = 0        # OPEN -> CLOSED transitions
    reopens: int = 0       # CLOSED -> OPEN transitions
    preemptions_by_request: dict[str, int] = field(default_factory=dict)
    # Delay between online turning busy and the gate actually closing (IterationGate only > 0).
    close_delays_s: list[float] = field(default_factory=list)

    def preemptions(self, request_id: str) -> int:
        return self.preemptions_by_request.get(request_id, 0)

    @property
    def max_preemptions_per_request(self) -> int:
        return max(self.preemptions_by_request.values(), default=0)


class ComputeGate:
    """Shared event handling; subclasses say when a requested close takes effect and when to reopen."""

    name = "base"

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        self.config = config
        self.stats = GateStats()
        self._state = GateState.OPEN
        self._now_s = -math.inf
        self._busy = False
        self._busy_ids: frozenset[str] = frozenset()
        self._busy_since_s: float | None = None
        self._idle_since_s: float | None = 0.0

    # --- events --------------------------------------------------------------------------

    def on_busy(self, now_s: float, request_ids: Iterable[str] = ()) -> None:
        """Online has compute in flight for these requests (call at each step start is fine)."""
        self._advance(now_s)
        ids = frozenset(request_ids)
        for rid in ids:
            if not isinstance(rid, str):
                raise PolicyInputError(f"request ids must be str, got {rid!r}")
            self.stats.preemptions_by_request.setdefault(rid, 0)
        if not self._busy:
            self._busy = True
            self._busy_since_s = now_s
            self._idle_since_s = None
        self._busy_ids = ids
        if self._state is GateState.OPEN and self._closes_now():
            self._close(now_s)

    def on_idle(self, now_s: float) -> None:
        """Online has no compute in flight (between steps, or no requests at all)."""
        self._advance(now_s)
        if self._busy:
            self._busy = False
            self._busy_ids = frozenset()
            self._busy_since_s = None
            self._idle_since_s = now_s

    def on_decode_step(self, now_s: float, request_ids: Iterable[str] = ()) -> None:
        """Online finished a decode step for these requests (used by gates that measure gaps)."""
        self._advance(now_s)

    def on_offline_iteration_boundary(self, now_s: float) -> None:
        """An offline engine finished one iteration (matters only to iteration-level gates)."""
        self._advance(now_s)

    def decide(self, now_s: float) -> GateDecision:
        """Advance time to now_s and say whether offline may run."""
        self._advance(now_s)
        if self._state is GateState.CLOSED and not self._busy:
            return GateDecision(open=False, reopen_at_s=self._reopen_at_s())
        return GateDecision(open=self._state is GateState.OPEN)

    # --- read-only views ---------------------------------------------------------------------

    @property
    def state(self) -> GateState:
        return self._state

    @property
    def online_busy(self) -> bool:
        return self._busy

    @property
    def cooldown_s(self) -> float:
        return 0.0

    # --- subclass hooks ----------------------------------------------------------------------

    def _closes_now(self) -> bool:
        return True

    def _reopen_at_s(self) -> float:
        assert self._idle_since_s is not None
        return self._idle_since_s + self.cooldown_s

    # --- internals ----------------------------------------------------------------------------

    def _advance(self, now_s: float) -> None:
        if not isinstance(now_s, (int, float)) or not math.isfinite(now_s):
            raise PolicyInputError(f"now_s must be a finite number, got {now_s!r}")
        if now_s < self._now_s:
            raise PolicyInputError(f"event at {now_s} s is earlier than the last one at {self._now_s} s")
        self._now_s = float(now_s)
        # Time passing is itself an event: a cooldown that ended before now reopens the gate
        # before whatever happens at now is applied.
        if self._state is GateState.CLOSED and not self._busy and now_s >= self._reopen_at_s():
            self._state = GateState.OPEN
            self.stats.reopens += 1

    def _close(self, now_s: float) -> None:
        self._state = GateState.CLOSED
        self.stats.pauses += 1
        assert self._busy_since_s is not None
        self.stats.close_delays_s.append(now_s - self._busy_since_s)
        for rid in self._busy_ids:
            self.stats.preemptions_by_request[rid] += 1


class LifecycleGate(ComputeGate):
    """Valve §4.2: close when online turns busy; reopen after a cooldown of continuous idleness."""

    name = "valve"

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        super().__init__(config)
        self._gaps_s: deque[float] = deque(maxlen=config.gap_window)
        self._last_step_s: float | None = None
        self._last_step_ids: frozenset[str] = frozenset()

    def on_decode_step(self, now_s: float, request_ids: Iterable[str] = ()) -> None:
        super().on_decode_step(now_s, request_ids)
        ids = frozenset(request_ids)
        # Only gaps inside one request's lifetime count: the pause between two unrelated
        # requests is not a decode gap and would inflate the cooldown.
        if self._last_step_s is not None and ids & self._last_step_ids:
            self._gaps_s.append(now_s - self._last_step_s)
        self._last_step_s = now_s
        self._last_step_ids = ids

    @property
    def longest_gap_s(self) -> float | None:
        return max(self._gaps_s) if self._gaps_s else None

    @property
    def cooldown_s(self) -> float:
        cfg = self.config
        gap_s = self.longest_gap_s
        if gap_s is None:
            return cfg.min_cooldown_s
        # Valve §4.2: cooldown = 2x the longest gap between decode iterations.
        return min(cfg.max_cooldown_s, max(cfg.min_cooldown_s, cfg.cooldown_factor * gap_s))


class TimesliceGate(ComputeGate):
    """GPreempt-style baseline: offline runs whenever online is idle, even between decode steps."""

    name = "timeslice"


class IterationGate(ComputeGate):
    """Iteration-level baseline: a close request waits for the next offline iteration boundary."""

    name = "iteration"

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        super().__init__(config)
        self._close_pending = False

    def on_idle(self, now_s: float) -> None:
        super().on_idle(now_s)
        # Online finished before offline reached a boundary: it never had to stop.
        self._close_pending = False

    def on_offline_iteration_boundary(self, now_s: float) -> None:
        super().on_offline_iteration_boundary(now_s)
        if self._close_pending and self._busy:
            self._close_pending = False
            self._close(now_s)

    @property
    def close_pending(self) -> bool:
        return self._close_pending

    def _closes_now(self) -> bool:
        self._close_pending = True
        return False


GATES: dict[str, type[ComputeGate]] = {g.name: g for g in (LifecycleGate, TimesliceGate, IterationGate)}


def make_gate(name: str, config: GateConfig = GateConfig()) -> ComputeGate:
    if name not in GATES:
        raise PolicyInputError(f"unknown gate {name!r}; choose one of {sorted(GATES)}")
    return GATES[name](config)
