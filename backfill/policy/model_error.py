"""How far the latency model's step estimates are from the steps that ran (ConServe §4.5).

A policy that plans on a latency model is only as good as the model: every co-serving report says
how far the estimates were off, on the steps the run executed, per step mode. The error of a step
is (predicted - measured) / measured, signed: positive where the model expected a slower step.
The policy also reads the recent spread back, to keep as much margin below the SLO as the model's
error needs (margin.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Samples kept per step mode for a run's report: enough for a stable P90, bounded in memory.
MAX_SAMPLES_PER_MODE = 20_000


@dataclass(frozen=True)
class ErrorSummary:
    """Relative error of one step mode's estimates: |predicted - measured| / measured."""

    steps: int
    median: float
    p90: float
    bias: float   # the median signed error: > 0 where the model expected slower steps

    def to_dict(self) -> dict:
        return {"steps": self.steps, "median": self.median, "p90": self.p90, "bias": self.bias}


def summarize(signed_errors: list[float]) -> ErrorSummary | None:
    if not signed_errors:
        return None
    import numpy as np  # here, not at import: the policy modules load for `--help` too

    e = np.asarray(signed_errors, dtype=float)
    a = np.abs(e)
    return ErrorSummary(len(e), float(np.median(a)), float(np.percentile(a, 90)), float(np.median(e)))


class ModelErrorLog:
    """Signed relative errors of a policy's step estimates, per step mode, oldest dropped first."""

    def __init__(self, max_samples: int = MAX_SAMPLES_PER_MODE) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._by_mode: dict[str, deque[float]] = {}

    def observe(self, mode: str, predicted_ms: float, measured_ms: float) -> float | None:
        """Record one executed step; returns its signed error (None for a step too short to time)."""
        if measured_ms <= 0 or predicted_ms <= 0:
            return None
        error = (predicted_ms - measured_ms) / measured_ms
        self._by_mode.setdefault(mode, deque(maxlen=self.max_samples)).append(error)
        return error

    def samples(self) -> dict[str, list[float]]:
        """Per step mode, the signed errors, rounded for a report's JSON."""
        return {mode: [round(e, 4) for e in errors] for mode, errors in self._by_mode.items()}

    def summary(self) -> dict[str, ErrorSummary]:
        return {mode: s for mode, errors in self._by_mode.items() if (s := summarize(list(errors))) is not None}
