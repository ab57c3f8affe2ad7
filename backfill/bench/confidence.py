"""How sure a latency ratio is: a paired bootstrap over the online requests.

The modes of a comparison replay the same trace, so each online request has a twin in the
baseline run (same id, same prompt, same send time). A P99 over ~200 requests is set by its two
or three slowest, and which requests those are moves with who prefilled next to whom. Resampling
the requests - the same draw for both modes - and taking the ratio of the two P99s each time gives
an interval for the ratio: how far it moves when a few different requests had landed in the tail.
It covers that sampling noise, not a machine that runs slower in one mode's minutes than in the
other's; rounds interleaved across the modes (`--rounds`) are what spread that out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from backfill.bench.metrics import RequestRecord
from backfill.errors import WorkloadError
from backfill.types import RequestClass


@dataclass(frozen=True)
class RatioInterval:
    ratio: float   # on all the paired requests
    low: float
    high: float
    pairs: int     # online requests measured in both modes


def paired_values(records: Sequence[RequestRecord], baseline: Sequence[RequestRecord],
                  value: Callable[[RequestRecord], float | None]) -> tuple[np.ndarray, np.ndarray]:
    """`value` of each online request measured in both runs, in matching order (by request id)."""
    base = {r.request_id: value(r) for r in baseline if r.request_class is RequestClass.ONLINE}
    mine, theirs = [], []
    for r in records:
        if r.request_class is not RequestClass.ONLINE:
            continue
        a, b = value(r), base.get(r.request_id)
        if a is not None and b is not None:
            mine.append(a)
            theirs.append(b)
    return np.asarray(mine, dtype=float), np.asarray(theirs, dtype=float)


def percentile_ratio_interval(values: np.ndarray, baseline: np.ndarray, percentile: float = 99.0,
                              level: float = 0.95, resamples: int = 2000, seed: int = 0) -> RatioInterval:
    """The ratio of the two percentiles, with a percentile-bootstrap interval at `level`."""
    if values.shape != baseline.shape or values.ndim != 1:
        raise WorkloadError("paired values must be two 1-D arrays of one length")
    if len(values) < 2:
        raise WorkloadError(f"need at least 2 paired requests for an interval, got {len(values)}")
    if not 0.0 < level < 1.0 or not 0.0 < percentile <= 100.0 or resamples < 1:
        raise WorkloadError("level must be in (0, 1), percentile in (0, 100], resamples >= 1")
    if np.percentile(baseline, percentile) <= 0:
        raise WorkloadError("the baseline's percentile is not positive: no ratio")
    draws = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    mine = np.percentile(values[draws], percentile, axis=1)
    theirs = np.percentile(baseline[draws], percentile, axis=1)
    ratios = mine / np.maximum(theirs, np.finfo(float).tiny)
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    ratio = float(np.percentile(values, percentile) / np.percentile(baseline, percentile))
    return RatioInterval(ratio, float(low), float(high), len(values))
