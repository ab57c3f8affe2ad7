"""The latency model corrected online from the steps the policy measures (ConServe §4.5).

The step-latency profile is measured once, on a quiet machine. When the machine slows later (a
noisy neighbour on a CPU core, thermal limits, another process on the GPU), every plan made on
the profile runs long: co-serving steps overrun the SLO budget and offline batches overrun the
preemption target. The policy already compares each planned step's prediction with its measured
time (model_error.py); this layer turns that error into one factor applied to every prediction:

- an EWMA of log(measured / predicted) over the steps that ran, weighted by their duration, so
  that it follows a slowdown within about one time constant of busy time (seconds), whatever the
  step rate, and one odd step moves it little (each step's ratio is clipped);
- the prediction it is compared with already carries the factor, so the factor converges where
  predictions are unbiased and returns to 1 when the machine does;
- bounded, so that a burst of outliers cannot stop offline work or lift budgets past reason;
- a factor that stays past the flag ratio for flag_after_s of wall time is a persisting drift:
  flagged once (a warning in the log, `needs_reprofile` and a count in the report) so that the
  profile is measured again (`backfill profile`).

It is a layer of its own over the profile, apart from what the profile's table says a step costs,
so a change in how the table prices a step composes with it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Timeline points kept for a run's report: one per REPORT_EVERY_S, bounded in memory.
REPORT_EVERY_S = 1.0
MAX_REPORT_POINTS = 4096


@dataclass(frozen=True)
class DriftConfig:
    time_constant_ms: float = 500.0  # busy time over which the EWMA forgets (1 - 1/e of its weight)
    min_factor: float = 0.5
    max_factor: float = 4.0
    step_clip: float = 2.0           # one step's ratio counts as at most this far from 1 (either way)
    flag_ratio: float = 1.25         # a factor past this (or under its inverse) is drift ...
    flag_after_s: float = 10.0       # ... once it has lasted this long

    def __post_init__(self) -> None:
        if not (self.time_constant_ms > 0 and 0 < self.min_factor <= 1.0 <= self.max_factor
                and self.step_clip > 1 and self.flag_ratio > 1 and self.flag_after_s >= 0):
            raise ValueError(f"invalid drift config {self}")


class LatencyDrift:
    """Measured over predicted step time, tracked online; `factor` multiplies the policy's estimates."""

    def __init__(self, config: DriftConfig = DriftConfig()) -> None:
        self.config = config
        self._log_factor = 0.0
        self.steps = 0
        self.max_factor_seen = 1.0
        self.flags = 0                       # persisting drifts flagged so far
        self.needs_reprofile = False         # a persisting drift is on now
        self._drift_since_s: float | None = None
        self.timeline: list[tuple[float, float]] = []  # (s, factor), one point per REPORT_EVERY_S

    @property
    def factor(self) -> float:
        return math.exp(self._log_factor)

    def observe(self, now_s: float, predicted_ms: float, measured_ms: float) -> None:
        """One step that ran: its prediction (made with the current factor) and its measured time."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        cfg = self.config
        step_log = min(max(math.log(measured_ms / predicted_ms), -math.log(cfg.step_clip)), math.log(cfg.step_clip))
        weight = 1.0 - math.exp(-measured_ms / cfg.time_constant_ms)
        self._log_factor = min(max(self._log_factor + weight * step_log, math.log(cfg.min_factor)),
                               math.log(cfg.max_factor))
        self.steps += 1
        factor = self.factor
        self.max_factor_seen = max(self.max_factor_seen, factor)
        if not self.timeline or now_s - self.timeline[-1][0] >= REPORT_EVERY_S:
            if len(self.timeline) < MAX_REPORT_POINTS:
                self.timeline.append((now_s, factor))
        self._check_persisting(now_s, factor)

    def _check_persisting(self, now_s: float, factor: float) -> None:
        cfg = self.config
        if 1.0 / cfg.flag_ratio < factor < cfg.flag_ratio:
            self._drift_since_s = None
            self.needs_reprofile = False
            return
        if self._drift_since_s is None:
            self._drift_since_s = now_s
        if not self.needs_reprofile and now_s - self._drift_since_s >= cfg.flag_after_s:
            self.needs_reprofile = True
            self.flags += 1
            log.warning("steps have run %.2fx the latency profile's estimate for %.0f s: the machine is not the "
                        "one profiled; budgets follow the measured steps, and `backfill profile` should be run "
                        "again", factor, now_s - self._drift_since_s)

    def report(self, t0_s: float = 0.0) -> dict:
        """For a run's report: the factor now, the largest seen, the flags and the timeline since t0_s."""
        return {"factor": round(self.factor, 4), "max_factor": round(self.max_factor_seen, 4), "steps": self.steps,
                "flags": self.flags, "needs_reprofile": self.needs_reprofile,
                "timeline": [(round(t - t0_s, 3), round(f, 4)) for t, f in self.timeline if t >= t0_s]}
