"""A benchmark target's verdict: the quantity judged, its value, the target, and whether it is met,
given only when enough samples back it.

A P99 over three requests is the largest of three numbers; a "met" printed from it claims more than
the run measured. Every report's `met` comes from a Verdict, which names its quantity and sample
count and says `n/a (too few samples: N)` below its stated minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# A P99 from fewer samples than this is close to the maximum of a handful; 20 is the least from
# which the 99th percentile still interpolates between the two largest of a spread.
MIN_SAMPLES_P99 = 20
# Counts of rare events (reclamations, preemption windows) judged against a rate or a ratio.
MIN_EVENTS = 5

COMPARISONS = ("<=", ">=", "within")


@dataclass(frozen=True)
class Verdict:
    quantity: str                  # what is judged, units included ("valve P99 pause ack, ms")
    value: float | None            # the measured figure (None: nothing measured)
    target: float
    samples: int                   # how many observations the value comes from
    min_samples: int               # below this the verdict is n/a
    comparison: str = "<="         # value <= target, value >= target, or within tolerance of target
    tolerance: float = 0.0         # "within": |value - target| <= tolerance * target
    sample_unit: str = "samples"   # what one sample is ("online requests", "reclamations")

    def __post_init__(self) -> None:
        if self.comparison not in COMPARISONS:
            raise ValueError(f"comparison must be one of {COMPARISONS}, got {self.comparison!r}")

    @property
    def enough_samples(self) -> bool:
        return self.samples >= self.min_samples and self.value is not None and math.isfinite(self.value)

    @property
    def met(self) -> bool | None:
        """True / False from enough samples; None (n/a) otherwise."""
        if not self.enough_samples:
            return None
        assert self.value is not None
        if self.comparison == "<=":
            return self.value <= self.target
        if self.comparison == ">=":
            return self.value >= self.target
        return abs(self.value - self.target) <= self.tolerance * abs(self.target)

    @property
    def met_text(self) -> str:
        met = self.met
        if met is None:
            return f"n/a (too few samples: {self.samples})"
        return "yes" if met else "no"

    def describe(self) -> str:
        """One line: `quantity: value (target ...; n=N of min M sample_unit): met=...`."""
        value = "-" if self.value is None else f"{self.value:.3g}"
        target = (f"{self.target:.3g} +/- {self.tolerance:.0%}" if self.comparison == "within"
                  else f"{self.comparison} {self.target:.3g}")
        return (f"{self.quantity}: {value} (target {target}; n={self.samples} {self.sample_unit}, "
                f"min {self.min_samples}): met={self.met_text}")

    def as_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "value": self.value, "target": self.target,
                "comparison": self.comparison, "tolerance": self.tolerance, "samples": self.samples,
                "min_samples": self.min_samples, "sample_unit": self.sample_unit, "met": self.met,
                "met_text": self.met_text}


def ratio_text(value: float | None, digits: int = 2) -> str:
    """A ratio as a user reads it: `1.11x` (`-` when nothing was measured)."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}x"


def closing_sentence(verdicts: list[Verdict]) -> str:
    """One sentence reading a run's targets: which were met, which missed (by how much), which
    stood on too few samples to judge, each with its sample count."""
    if not verdicts:
        return "No target was judged."
    parts = []
    met = [v for v in verdicts if v.met is True]
    missed = [v for v in verdicts if v.met is False]
    thin = [v for v in verdicts if v.met is None]
    if met:
        parts.append(f"met {len(met)} of {len(verdicts)} targets (" + "; ".join(
            f"{v.quantity} {v.value:.3g} {_against(v)}, n={v.samples}" for v in met) + ")")
    if missed:
        parts.append(f"missed {len(missed)} (" + "; ".join(
            f"{v.quantity} {v.value:.3g} {_against(v)}, n={v.samples}" for v in missed) + ")")
    if thin:
        parts.append(f"could not judge {len(thin)} (" + "; ".join(
            f"{v.quantity}: {v.samples} {v.sample_unit}, {v.min_samples} needed" for v in thin) + ")")
    text = "; ".join(parts)
    return "This run " + text + "."


def _against(v: Verdict) -> str:
    if v.comparison == "within":
        return f"against {v.target:.3g} +/- {v.tolerance:.0%}"
    return f"against the target {v.comparison} {v.target:.3g}"
