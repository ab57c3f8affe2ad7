"""Arrival processes of the open-loop load generator, deterministic from a seed.

Every generator returns arrival times in seconds from the start of the run, as a sorted float64
numpy array, and draws only from the numpy Generator it is given (or one seeded from an int):
the same seed always gives the same trace, and the wall clock is never read.

Inter-arrival gaps are gamma distributed with mean 1/rate and coefficient of variation cv:

    shape k = 1 / cv**2,   scale = 1 / (rate * k)

cv = 1 is a Poisson process (exponential gaps); cv > 1 is burstier, cv < 1 more regular.
vLLM's `bench serve --burstiness B` is the same gamma family with B = k = 1/cv**2, so
`--burstiness 0.25` there equals cv = 2 here.

The first arrival comes one gap after t = 0 (a renewal process started at 0), so over a long
run `count / last_arrival` estimates the rate without a bias from an arrival pinned at 0.

Time-varying load (ON/OFF phases, step changes of rate) is a piecewise-constant rate: a unit-rate
gamma renewal process is drawn in "operational time" Lambda(t) = integral of rate(t) dt and mapped
back through Lambda^-1, so each phase keeps the requested cv and gets exactly its rate; a phase
of rate 0 gets no arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backfill.errors import WorkloadError
from backfill.validation import check_positive

Seed = int | np.random.Generator


def as_rng(seed: Seed) -> np.random.Generator:
    """A numpy Generator from an int seed (or the Generator itself, to share one stream)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise WorkloadError(f"seed must be a non-negative integer or a numpy Generator, got {seed!r}")
    return np.random.default_rng(int(seed))


def gamma_shape(cv: float) -> float:
    """Gamma shape k for a coefficient of variation cv (vLLM's burstiness is this k)."""
    check_positive(WorkloadError, "cv", cv)
    return 1.0 / (cv * cv)


def cv_from_burstiness(burstiness: float) -> float:
    """The cv equivalent of vLLM's `--burstiness` (gamma shape): cv = 1/sqrt(burstiness)."""
    check_positive(WorkloadError, "burstiness", burstiness)
    return 1.0 / math.sqrt(burstiness)


def gamma_arrivals(rate_per_s: float, cv: float, seed: Seed, *, duration_s: float | None = None,
                   count: int | None = None) -> np.ndarray:
    """Arrivals of a gamma renewal process: all in [0, duration_s), or exactly `count` of them."""
    check_positive(WorkloadError, "rate_per_s", rate_per_s)
    return _unit_renewal(cv, as_rng(seed), _horizon(duration_s, count, rate_per_s)) / rate_per_s


def poisson_arrivals(rate_per_s: float, seed: Seed, *, duration_s: float | None = None,
                     count: int | None = None) -> np.ndarray:
    """Arrivals of a Poisson process (gamma with cv = 1)."""
    return gamma_arrivals(rate_per_s, 1.0, seed, duration_s=duration_s, count=count)


def uniform_arrivals(rate_per_s: float, *, duration_s: float | None = None, count: int | None = None,
                     offset_s: float = 0.0) -> np.ndarray:
    """Evenly spaced arrivals every 1/rate seconds starting at offset_s (DISB's uniform clients, REEF §6.2)."""
    check_positive(WorkloadError, "rate_per_s", rate_per_s)
    if not math.isfinite(offset_s) or offset_s < 0:
        raise WorkloadError(f"offset_s must be a finite number >= 0, got {offset_s!r}")
    _check_horizon(duration_s, count)
    if count is not None:
        return offset_s + np.arange(count, dtype=np.float64) / rate_per_s
    n = max(0, math.ceil((duration_s - offset_s) * rate_per_s))
    times = offset_s + np.arange(n, dtype=np.float64) / rate_per_s
    return times[times < duration_s]


def piecewise_arrivals(segments: Sequence[tuple[float, float]], duration_s: float, seed: Seed, *,
                       cv: float = 1.0) -> np.ndarray:
    """Arrivals in [0, duration_s) under a piecewise-constant rate.

    segments: (start_s, rate_per_s) pairs; the first must start at 0, starts strictly increase,
    and each rate holds until the next start (the last one until duration_s). Rates may be 0.
    """
    starts, rates = _check_segments(segments)
    check_positive(WorkloadError, "duration_s", duration_s)
    ends = np.append(starts[1:], max(duration_s, starts[-1]))
    ends = np.minimum(ends, duration_s)
    spans = np.maximum(ends - starts, 0.0)
    lam_starts = np.concatenate(([0.0], np.cumsum(rates * spans)[:-1]))
    lam_total = float(np.sum(rates * spans))
    if lam_total == 0.0:
        return np.empty(0, dtype=np.float64)
    units = _unit_renewal(cv, as_rng(seed), ("duration", lam_total))
    # side="right" skips zero-rate phases (equal Lambda at their start and end) to the live one.
    idx = np.searchsorted(lam_starts, units, side="right") - 1
    times = starts[idx] + (units - lam_starts[idx]) / rates[idx]
    return np.minimum(times, np.nextafter(duration_s, 0.0))


def step_arrivals(steps: Sequence[tuple[float, float]], duration_s: float, seed: Seed, *,
                  cv: float = 1.0) -> np.ndarray:
    """Step changes of rate: steps = [(start_s, rate_per_s), ...], e.g. [(0, 2), (60, 8), (120, 2)]."""
    return piecewise_arrivals(steps, duration_s, seed, cv=cv)


def on_off_arrivals(rate_on_per_s: float, on_s: float, off_s: float, duration_s: float, seed: Seed, *,
                    cv: float = 1.0, rate_off_per_s: float = 0.0) -> np.ndarray:
    """ON/OFF phases (ConServe §6, Figure 6): rate_on for on_s seconds, then rate_off for off_s, repeated.

    The run starts with an ON phase.
    """
    check_positive(WorkloadError, "rate_on_per_s", rate_on_per_s)
    check_positive(WorkloadError, "on_s", on_s)
    check_positive(WorkloadError, "off_s", off_s)
    check_positive(WorkloadError, "duration_s", duration_s)
    if not math.isfinite(rate_off_per_s) or rate_off_per_s < 0:
        raise WorkloadError(f"rate_off_per_s must be a finite number >= 0, got {rate_off_per_s!r}")
    segments: list[tuple[float, float]] = []
    t = 0.0
    while t < duration_s:
        segments.append((t, rate_on_per_s))
        if t + on_s < duration_s:
            segments.append((t + on_s, rate_off_per_s))
        t += on_s + off_s
    return piecewise_arrivals(segments, duration_s, seed, cv=cv)


def _unit_renewal(cv: float, rng: np.random.Generator, horizon: tuple[str, float]) -> np.ndarray:
    """Arrival times of a rate-1 gamma renewal process until the horizon (count, or duration)."""
    k = gamma_shape(cv)
    kind, value = horizon
    if kind == "count":
        return np.cumsum(rng.gamma(k, 1.0 / k, size=int(value)))
    # Draw in chunks sized from the expected count, so the stream of draws depends on the seed only.
    chunk = int(value * 1.1) + 16
    times = np.cumsum(rng.gamma(k, 1.0 / k, size=chunk))
    while times[-1] < value:
        times = np.concatenate((times, times[-1] + np.cumsum(rng.gamma(k, 1.0 / k, size=chunk))))
    return times[times < value]


def _horizon(duration_s: float | None, count: int | None, rate_per_s: float) -> tuple[str, float]:
    _check_horizon(duration_s, count)
    if count is not None:
        return ("count", count)
    return ("duration", duration_s * rate_per_s)


def _check_horizon(duration_s: float | None, count: int | None) -> None:
    if (duration_s is None) == (count is None):
        raise WorkloadError("give exactly one of duration_s and count")
    if count is not None and (not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 0):
        raise WorkloadError(f"count must be a non-negative integer, got {count!r}")
    if duration_s is not None:
        check_positive(WorkloadError, "duration_s", duration_s)


def _check_segments(segments: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    if not segments:
        raise WorkloadError("a piecewise rate needs at least one (start_s, rate_per_s) segment")
    try:
        starts = np.array([float(s) for s, _ in segments])
        rates = np.array([float(r) for _, r in segments])
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"segments must be (start_s, rate_per_s) pairs of numbers: {exc}") from None
    if starts[0] != 0.0:
        raise WorkloadError(f"the first segment must start at 0 s, got {starts[0]}")
    if not np.all(np.isfinite(starts)) or np.any(np.diff(starts) <= 0):
        raise WorkloadError("segment starts must be finite and strictly increasing")
    if not np.all(np.isfinite(rates)) or np.any(rates < 0):
        raise WorkloadError("segment rates must be finite and >= 0")
    return starts, rates


_ARRIVAL_USAGE = ("expected poisson:RATE, gamma:RATE:CV, uniform:RATE, onoff:RATE_ON:ON_S:OFF_S[:RATE_OFF] "
                  "or steps:START=RATE,START=RATE,... (optionally ending in @CV, e.g. onoff:8:10:5@2)")


@dataclass(frozen=True)
class ArrivalSpec:
    """An arrival process from its CLI form; `generate` draws its arrivals for a run of duration_s.

    poisson:4            4 req/s, exponential gaps
    gamma:4:2            4 req/s, gamma gaps with cv 2 (vLLM --burstiness 0.25)
    uniform:4            every 0.25 s (DISB's uniform clients)
    onoff:8:10:5[:1]     8 req/s for 10 s, then 1 (default 0) req/s for 5 s, repeated
    steps:0=2,60=8       2 req/s from 0 s, 8 req/s from 60 s
    A suffix @CV sets the gap cv of onoff and steps (default 1).
    """

    kind: str
    rate_per_s: float = 0.0
    cv: float = 1.0
    on_s: float = 0.0
    off_s: float = 0.0
    rate_off_per_s: float = 0.0
    steps: tuple[tuple[float, float], ...] = ()

    def generate(self, seed: Seed, duration_s: float) -> np.ndarray:
        if self.kind in ("poisson", "gamma"):
            return gamma_arrivals(self.rate_per_s, self.cv, seed, duration_s=duration_s)
        if self.kind == "uniform":
            return uniform_arrivals(self.rate_per_s, duration_s=duration_s)
        if self.kind == "onoff":
            return on_off_arrivals(self.rate_per_s, self.on_s, self.off_s, duration_s, seed, cv=self.cv,
                                   rate_off_per_s=self.rate_off_per_s)
        return step_arrivals(self.steps, duration_s, seed, cv=self.cv)

    def __str__(self) -> str:
        if self.kind == "poisson" or self.kind == "uniform":
            return f"{self.kind}:{self.rate_per_s:g}"
        if self.kind == "gamma":
            return f"gamma:{self.rate_per_s:g}:{self.cv:g}"
        tail = f"@{self.cv:g}" if self.cv != 1.0 else ""
        if self.kind == "onoff":
            off = f":{self.rate_off_per_s:g}" if self.rate_off_per_s else ""
            return f"onoff:{self.rate_per_s:g}:{self.on_s:g}:{self.off_s:g}{off}{tail}"
        return "steps:" + ",".join(f"{s:g}={r:g}" for s, r in self.steps) + tail


def parse_arrival_spec(text: str) -> ArrivalSpec:
    """An ArrivalSpec from its CLI form, validated (bad values raise WorkloadError)."""
    if not isinstance(text, str) or ":" not in text:
        raise WorkloadError(f"bad arrival spec {text!r}; {_ARRIVAL_USAGE}")
    body, _, cv_text = text.strip().partition("@")
    kind, _, rest = body.partition(":")
    try:
        cv = float(cv_text) if cv_text else 1.0
        if kind == "steps":
            pairs = [p.split("=") for p in rest.split(",")]
            if any(len(p) != 2 for p in pairs):
                raise WorkloadError(f"steps need START=RATE pairs, got {rest!r}")
            steps = tuple((float(s), float(r)) for s, r in pairs)
            _check_segments(steps)
            spec = ArrivalSpec("steps", cv=cv, steps=steps)
        else:
            args = [float(a) for a in rest.split(":")]
            arity = {"poisson": (1,), "gamma": (2,), "uniform": (1,), "onoff": (3, 4)}
            if kind not in arity:
                raise WorkloadError(f"unknown arrival process {kind!r}")
            if len(args) not in arity[kind]:
                raise WorkloadError(f"{kind} takes {' or '.join(map(str, arity[kind]))} parameter(s), got {len(args)}")
            if cv_text and kind not in ("onoff", "steps"):
                raise WorkloadError(f"@CV applies to onoff and steps; give gamma:RATE:CV for {kind}")
            if kind == "onoff":
                spec = ArrivalSpec("onoff", args[0], cv, args[1], args[2], args[3] if len(args) == 4 else 0.0)
                check_positive(WorkloadError, "on_s", spec.on_s)
                check_positive(WorkloadError, "off_s", spec.off_s)
                if spec.rate_off_per_s < 0:
                    raise WorkloadError("the OFF rate must be >= 0")
            else:
                spec = ArrivalSpec(kind, args[0], args[1] if kind == "gamma" else cv)
            check_positive(WorkloadError, "rate_per_s", spec.rate_per_s)
        check_positive(WorkloadError, "cv", spec.cv)
        return spec
    except WorkloadError as exc:
        raise WorkloadError(f"{exc} (in arrival spec {text!r}); {_ARRIVAL_USAGE}") from None
    except ValueError as exc:
        raise WorkloadError(f"bad number in arrival spec {text!r}: {exc}; {_ARRIVAL_USAGE}") from None
