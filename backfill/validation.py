"""Value checks shared by the config dataclasses and workload specs.

One rule per kind of value, so a port, a count or a duration is judged the same everywhere; each
check raises the caller's typed error (a BackfillError subclass) naming the field. numpy scalars
count as numbers (workload specs are often built from numpy draws); bools never do.
"""

from __future__ import annotations

import math
import numbers

from backfill.errors import BackfillError


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(error: type[BackfillError], name: str, value: object, low: int, high: int | None = None) -> None:
    """An integer in [low, high] (no upper bound when high is None)."""
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise error(f"{name} must be an integer {bound}, got {value!r}")


def check_positive(error: type[BackfillError], name: str, value: object) -> None:
    """A finite number > 0."""
    if not is_finite_number(value) or value <= 0:
        raise error(f"{name} must be a positive number, got {value!r}")


def check_non_negative(error: type[BackfillError], name: str, value: object) -> None:
    """A finite number >= 0."""
    if not is_finite_number(value) or value < 0:
        raise error(f"{name} must be a non-negative number, got {value!r}")
