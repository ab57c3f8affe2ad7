"""Token-length distributions for prompts and outputs, parsed from short CLI strings.

    fixed:N                 always N tokens
    uniform:LO:HI           integers in [LO, HI], both ends included
    lognormal:MEDIAN:SIGMA[:MAX]
                            exp(Normal(ln MEDIAN, SIGMA)), rounded, clipped to [1, MAX]
                            (MAX defaults to 16 x MEDIAN); mean = MEDIAN * exp(SIGMA**2 / 2)
    zipf:A:MAX              P(n) proportional to n**-A over n = 1..MAX (A > 0; heavy tail of
                            short lengths with rare long ones)

Every sample is an int64 numpy array of values >= 1, drawn only from the Generator passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backfill.errors import WorkloadError
from backfill.validation import check_int, is_finite_number


@dataclass(frozen=True)
class FixedLength:
    tokens: int

    def __post_init__(self) -> None:
        check_int(WorkloadError, "fixed length", self.tokens, 1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)

    def __str__(self) -> str:
        return f"fixed:{self.tokens}"


@dataclass(frozen=True)
class UniformLength:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        check_int(WorkloadError, "uniform lo", self.lo, 1)
        check_int(WorkloadError, "uniform hi", self.hi, 1)
        if self.hi < self.lo:
            raise WorkloadError(f"uniform needs lo <= hi, got {self.lo} > {self.hi}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)

    def __str__(self) -> str:
        return f"uniform:{self.lo}:{self.hi}"


@dataclass(frozen=True)
class LognormalLength:
    median: float
    sigma: float
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not is_finite_number(self.median) or self.median < 1:
            raise WorkloadError(f"lognormal median must be a number >= 1, got {self.median!r}")
        if not is_finite_number(self.sigma) or self.sigma < 0:
            raise WorkloadError(f"lognormal sigma must be a finite number >= 0, got {self.sigma!r}")
        if self.max_tokens is not None:
            check_int(WorkloadError, "lognormal max", self.max_tokens, 1)
            if self.max_tokens < self.median:
                raise WorkloadError(f"lognormal max {self.max_tokens} is below the median {self.median}")

    @property
    def cap(self) -> int:
        return self.max_tokens if self.max_tokens is not None else int(math.ceil(16 * self.median))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), 1, self.cap).astype(np.int64)

    def __str__(self) -> str:
        tail = f":{self.max_tokens}" if self.max_tokens is not None else ""
        return f"lognormal:{self.median:g}:{self.sigma:g}{tail}"


@dataclass(frozen=True)
class ZipfLength:
    a: float
    max_tokens: int

    def __post_init__(self) -> None:
        if not is_finite_number(self.a) or self.a <= 0:
            raise WorkloadError(f"zipf exponent must be a positive number, got {self.a!r}")
        check_int(WorkloadError, "zipf max", self.max_tokens, 1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Bounded support by inverse CDF, so any a > 0 works (numpy's zipf needs a > 1 and is unbounded).
        weights = np.arange(1, self.max_tokens + 1, dtype=np.float64) ** -self.a
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        idx = np.searchsorted(cdf, rng.random(size=n), side="right")
        return np.minimum(idx, self.max_tokens - 1).astype(np.int64) + 1

    def __str__(self) -> str:
        return f"zipf:{self.a:g}:{self.max_tokens}"


LengthSpec = FixedLength | UniformLength | LognormalLength | ZipfLength

_USAGE = "expected fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX] or zipf:A:MAX"


def parse_length_spec(text: str) -> LengthSpec:
    """A LengthSpec from its CLI form; a bare integer means fixed."""
    if not isinstance(text, str) or not text.strip():
        raise WorkloadError(f"empty length spec; {_USAGE}")
    kind, *args = [p.strip() for p in text.strip().split(":")]
    if kind.isdigit() and not args:
        return FixedLength(int(kind))
    arity = {"fixed": (1,), "uniform": (2,), "lognormal": (2, 3), "zipf": (2,)}
    if kind not in arity:
        raise WorkloadError(f"unknown length distribution {kind!r} in {text!r}; {_USAGE}")
    if len(args) not in arity[kind]:
        raise WorkloadError(f"{kind} takes {' or '.join(map(str, arity[kind]))} parameter(s), got {len(args)} "
                            f"in {text!r}; {_USAGE}")
    try:
        if kind == "fixed":
            return FixedLength(_int(args[0]))
        if kind == "uniform":
            return UniformLength(_int(args[0]), _int(args[1]))
        if kind == "lognormal":
            return LognormalLength(float(args[0]), float(args[1]), _int(args[2]) if len(args) == 3 else None)
        return ZipfLength(float(args[0]), _int(args[1]))
    except ValueError as exc:
        if isinstance(exc, WorkloadError):
            raise WorkloadError(f"{exc} (in {text!r})") from None
        raise WorkloadError(f"bad number in length spec {text!r}: {exc}; {_USAGE}") from None


def _int(text: str) -> int:
    value = float(text)
    if not value.is_integer():
        raise WorkloadError(f"token counts must be whole numbers, got {text!r}")
    return int(value)
