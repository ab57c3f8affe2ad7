"""MIAD online headroom reservation (Valve §5, "Dynamic MIAD-style memory reservation").

The online engine keeps a headroom of pre-granted memory handles so that a burst is served
from the reservation instead of reclaiming offline memory on the critical path.

    pressure event  online use reaches 90% of what it was granted (use + headroom):
                    headroom is multiplied by `increase_factor` (multiplicative increase), at
                    every observation until use is back under 90%; one excursion above the
                    threshold counts as one event, and so does every allocation inside an
                    excursion that the headroom could not cover (`headroom_missed`): each of
                    those takes memory from offline, which is what the target bounds.
    no pressure     the headroom shrinks by one handle every `interval` (additive decrease).
    the interval    is itself MIAD-controlled, once every `control_period_s`: with the rate over
                    the sliding window above the user's target and new events since the last
                    period, it is multiplied by `interval_factor` (shrink more slowly); with the
                    rate at or under the target, it drops by `interval_step_s`. (Valve does not
                    say how often it compares. Raising only on new events keeps events that
                    are still in the window from compounding the increase period after period;
                    raising at most once per period keeps one burst from counting as many.
                    Until a window has passed, the rate is over the time seen so far.)

This drives the pressure-event rate -- and hence the reclamation rate -- toward the target.
Pure object: the caller passes the time with every observation.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from backfill.errors import PolicyInputError


@dataclass(frozen=True)
class MIADConfig:
    target_events_per_min: float = 1.0
    initial_headroom_handles: int = 1
    min_headroom_handles: int = 0
    max_headroom_handles: int = 1 << 20
    pressure_threshold: float = 0.9          # Valve §5: pressure when use reaches 90% of the grant
    increase_factor: float = 2.0
    initial_interval_s: float = 5.0
    min_interval_s: float = 0.5
    max_interval_s: float = 300.0
    interval_factor: float = 2.0
    interval_step_s: float = 1.0
    rate_window_s: float = 60.0
    control_period_s: float = 5.0            # how often the interval is compared with the target

    def __post_init__(self) -> None:
        def bad(msg: str) -> PolicyInputError:
            return PolicyInputError(f"MIADConfig: {msg}")
        if not (math.isfinite(self.target_events_per_min) and self.target_events_per_min > 0):
            raise bad(f"target_events_per_min must be > 0, got {self.target_events_per_min}")
        if not 0 <= self.min_headroom_handles <= self.initial_headroom_handles <= self.max_headroom_handles:
            raise bad("need 0 <= min_headroom_handles <= initial_headroom_handles <= max_headroom_handles")
        if not 0.0 < self.pressure_threshold <= 1.0:
            raise bad(f"pressure_threshold must be in (0, 1], got {self.pressure_threshold}")
        if not (self.increase_factor > 1.0 and self.interval_factor > 1.0):
            raise bad("increase_factor and interval_factor must be > 1")
        if not 0.0 < self.min_interval_s <= self.initial_interval_s <= self.max_interval_s < math.inf:
            raise bad("need 0 < min_interval_s <= initial_interval_s <= max_interval_s < inf")
        if not (self.interval_step_s > 0 and self.rate_window_s > 0 and self.control_period_s > 0):
            raise bad("interval_step_s, rate_window_s and control_period_s must be > 0")


class MIADReservation:
    """Headroom (in handles) the online engine should hold beyond what it uses."""

    def __init__(self, config: MIADConfig = MIADConfig(), now_s: float = 0.0) -> None:
        self.config = config
        self._headroom = config.initial_headroom_handles
        self._interval_s = config.initial_interval_s
        self._now_s = float(now_s)
        self._start_s = float(now_s)
        self._last_change_s = float(now_s)   # the additive-decrease clock
        self._next_control_s = float(now_s) + config.control_period_s
        self._in_pressure = False
        self._new_events = 0                 # events since the last control period
        self._events_s: deque[float] = deque()
        self.pressure_events = 0

    @property
    def headroom_handles(self) -> int:
        return self._headroom

    @property
    def release_interval_s(self) -> float:
        return self._interval_s

    def events_per_min(self, now_s: float) -> float:
        """Pressure-event rate over the sliding window ending at now_s."""
        self._check_time(now_s)
        self._expire(now_s)
        return self._rate_per_min(now_s)

    def observe(self, now_s: float, used_handles: int, granted_handles: int, *,
                headroom_missed: bool = False) -> int:
        """Feed the online engine's current use and grant; returns the headroom to keep.

        headroom_missed: this use comes from an allocation larger than the headroom held.
        """
        self._check_time(now_s)
        if not (isinstance(used_handles, int) and isinstance(granted_handles, int)
                and 0 <= used_handles <= granted_handles):
            raise PolicyInputError(f"need 0 <= used <= granted, got {used_handles}, {granted_handles}")
        self._now_s = float(now_s)
        cfg = self.config
        self._decay(now_s)
        pressure = used_handles >= cfg.pressure_threshold * granted_handles and used_handles > 0
        if pressure:
            # Multiplicative increase on every observation under pressure, so the headroom
            # grows until use falls below the threshold (and then stops: the growth is
            # self-limiting). One event per excursion above the threshold, plus one per
            # allocation inside it that the headroom could not cover.
            self._headroom = min(cfg.max_headroom_handles,
                                 max(self._headroom + 1, math.ceil(self._headroom * cfg.increase_factor)))
            if not self._in_pressure or headroom_missed:
                self.pressure_events += 1
                self._events_s.append(now_s)
                self._new_events += 1
        if pressure or self._in_pressure:
            # The additive-decrease clock starts when pressure is last seen.
            self._last_change_s = now_s
        self._in_pressure = pressure
        return self._headroom

    def advance(self, now_s: float) -> int:
        """Let time pass without a new observation (applies due additive decreases)."""
        self._check_time(now_s)
        self._now_s = float(now_s)
        self._decay(now_s)
        return self._headroom

    def _decay(self, now_s: float) -> None:
        cfg = self.config
        while self._next_control_s <= now_s:
            self._adapt_interval(self._next_control_s)
            self._next_control_s += cfg.control_period_s
            if not self._events_s and self._interval_s <= cfg.min_interval_s:
                # Nothing left to adapt: skip the idle periods instead of looping over them.
                skipped = math.floor((now_s - self._next_control_s) / cfg.control_period_s) + 1
                self._next_control_s += max(0, skipped) * cfg.control_period_s
        # Additive decrease: one handle per elapsed interval without pressure.
        if not self._in_pressure and now_s - self._last_change_s >= self._interval_s:
            ticks = math.floor((now_s - self._last_change_s) / self._interval_s)
            self._headroom = max(cfg.min_headroom_handles, self._headroom - ticks)
            self._last_change_s += ticks * self._interval_s

    def _adapt_interval(self, at_s: float) -> None:
        cfg = self.config
        self._expire(at_s)
        new_events, self._new_events = self._new_events, 0
        if self._rate_per_min(at_s) <= cfg.target_events_per_min:
            self._interval_s = max(cfg.min_interval_s, self._interval_s - cfg.interval_step_s)
        elif new_events:
            self._interval_s = min(cfg.max_interval_s, self._interval_s * cfg.interval_factor)

    def _rate_per_min(self, now_s: float) -> float:
        # Until a whole window has passed, the rate is over the time observed so far, so a
        # window's worth of events does not pass unchecked at start; but never over less than
        # the time one event may take at the target, so a single event is never over target.
        cfg = self.config
        span_s = min(cfg.rate_window_s, max(now_s - self._start_s, 60.0 / cfg.target_events_per_min))
        return len(self._events_s) * 60.0 / span_s

    def _expire(self, now_s: float) -> None:
        while self._events_s and self._events_s[0] <= now_s - self.config.rate_window_s:
            self._events_s.popleft()

    def _check_time(self, now_s: float) -> None:
        if not isinstance(now_s, (int, float)) or not math.isfinite(now_s):
            raise PolicyInputError(f"now_s must be a finite number, got {now_s!r}")
        if now_s < self._now_s:
            raise PolicyInputError(f"observation at {now_s} s is earlier than the last one at {self._now_s} s")
