"""Per-request records and the metrics of a run, with vLLM `bench serve` conventions.

All times in a RequestRecord are seconds since the start of the run. Per request:
  TTFT = first token - send;  E2E = end - send;
  TPOT = (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  ITL  = every gap between consecutive streamed chunks (a chunk may carry several tokens, as in
         vLLM, where a chunk is one engine step's output).
Each is summarized as mean, p50, p90, p99 and max in milliseconds (numpy linear percentiles).

Goodput (DistServe's term, as in vLLM): online requests per second that completed and met both
the TTFT and the TPOT SLO (TPOT counts as met when it is undefined). Throughput per class counts
output tokens streamed inside the measurement window [0, duration_s]; the window ends when the last
online request finishes, so offline work still running after that is not credited.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from backfill.errors import WorkloadError
from backfill.types import SLO, RequestClass


@dataclass
class RequestRecord:
    """What the driver saw of one request; filled in as it streams."""

    request_id: str
    request_class: RequestClass
    client: str = ""
    scheduled_s: float | None = None      # open loop: when it was due; closed loop: None
    send_s: float | None = None
    first_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    cancelled: bool = False               # stopped by the driver (offline work cut at the end of the run)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end_s is not None and self.output_tokens > 0

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None or self.send_s is None:
            return None
        return (self.first_token_s - self.send_s) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        if not self.ok:
            return None
        return (self.end_s - self.send_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def itls_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    @property
    def send_lag_ms(self) -> float | None:
        if self.scheduled_s is None or self.send_s is None:
            return None
        return (self.send_s - self.scheduled_s) * 1e3

    def to_json(self) -> dict:
        out = asdict(self)
        out["request_class"] = self.request_class.value
        out.update(ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms, e2e_ms=self.e2e_ms, send_lag_ms=self.send_lag_ms)
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "RequestRecord":
        """A record as `to_json` wrote it (the derived latencies are recomputed, not read)."""
        try:
            fields = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
            fields["request_class"] = RequestClass(raw["request_class"])
            return cls(**fields)
        except (KeyError, ValueError, TypeError) as exc:
            raise WorkloadError(f"not a request record: {exc}") from exc


class PreemptionEvent(NamedTuple):
    """One preemption of offline work, as the engine reports it (ConServe §4.3)."""

    time_s: float        # since the start of the run
    latency_ms: float    # from the preemption request until the offline work yielded


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> "Summary":
        x = np.asarray([v for v in values if v is not None], dtype=np.float64)
        if x.size == 0:
            return cls(0, None, None, None, None, None)
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        return cls(int(x.size), float(x.mean()), float(p50), float(p90), float(p99), float(x.max()))


@dataclass(frozen=True)
class ClassStats:
    """Metrics of one request class (online or offline)."""

    requests: int              # sent
    completed: int
    failed: int
    cancelled: int
    output_tokens: int         # streamed inside the window
    tokens_per_s: float
    requests_per_s: float      # completed per second of the window
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary


@dataclass(frozen=True)
class TimeSeries:
    bucket_s: float
    t_s: list[float]                          # bucket starts
    tokens_per_s: dict[str, list[float]]      # per class: output tokens/s streamed in the bucket
    engine: dict[str, list[float | None]]     # per sampled stat: bucket mean (None: no sample)


@dataclass(frozen=True)
class BenchMetrics:
    duration_s: float
    online: ClassStats
    offline: ClassStats
    total_tokens_per_s: float
    slo: SLO | None
    goodput_rps: float | None
    slo_attainment: float | None       # share of online requests (sent) that met the SLO
    preemptions: int
    preemptions_per_online_request: float | None
    preemption_latency_ms: Summary
    send_lag_ms: Summary
    timeseries: TimeSeries

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(records: Sequence[RequestRecord], *, slo: SLO | None = None, duration_s: float | None = None,
                    engine_samples: Sequence[tuple[float, Mapping[str, object]]] = (),
                    preemption_events: Sequence[PreemptionEvent | tuple[float, float]] | None = None,
                    bucket_s: float = 1.0) -> BenchMetrics:
    """Metrics of a run from its records, engine stat samples, and preemption events.

    preemption_events None: count preemptions from the records (`num_preemptions`), no latencies.
    """
    if not records:
        raise WorkloadError("no request records to compute metrics from")
    if not math.isfinite(bucket_s) or bucket_s <= 0:
        raise WorkloadError(f"bucket_s must be a positive number, got {bucket_s!r}")
    duration_s = _window(records) if duration_s is None else duration_s
    if not math.isfinite(duration_s) or duration_s <= 0:
        raise WorkloadError(f"duration_s must be a positive number, got {duration_s!r}")
    online = [r for r in records if r.request_class is RequestClass.ONLINE]
    offline = [r for r in records if r.request_class is RequestClass.OFFLINE]
    goodput = attainment = None
    if slo is not None:
        good = sum(1 for r in online if r.ok and r.ttft_ms <= slo.ttft_ms
                   and (r.tpot_ms is None or r.tpot_ms <= slo.tpot_ms))
        goodput = good / duration_s
        attainment = good / len(online) if online else None
    if preemption_events is None:
        count, latencies = sum(r.num_preemptions for r in records), []
    else:
        events = [PreemptionEvent(*e) for e in preemption_events]
        count, latencies = len(events), [e.latency_ms for e in events]
    on, off = _class_stats(online, duration_s), _class_stats(offline, duration_s)
    return BenchMetrics(
        duration_s=duration_s, online=on, offline=off,
        total_tokens_per_s=on.tokens_per_s + off.tokens_per_s,
        slo=slo, goodput_rps=goodput, slo_attainment=attainment,
        preemptions=count, preemptions_per_online_request=count / len(online) if online else None,
        preemption_latency_ms=Summary.of(latencies),
        send_lag_ms=Summary.of(r.send_lag_ms for r in records),
        timeseries=_timeseries(records, engine_samples, duration_s, bucket_s))


def _window(records: Sequence[RequestRecord]) -> float:
    online_ends = [r.end_s for r in records if r.request_class is RequestClass.ONLINE and r.end_s is not None]
    ends = online_ends or [r.end_s for r in records if r.end_s is not None]
    if not ends:
        raise WorkloadError("no request ended, so the run has no measurement window; pass duration_s")
    return max(ends)


def _class_stats(records: list[RequestRecord], duration_s: float) -> ClassStats:
    ok = [r for r in records if r.ok]
    tokens = sum(n for r in records for t, n in zip(r.chunk_times_s, r.chunk_tokens) if t <= duration_s)
    return ClassStats(
        requests=len(records), completed=len(ok),
        failed=sum(1 for r in records if r.error is not None),
        cancelled=sum(1 for r in records if r.cancelled and r.error is None),
        output_tokens=tokens, tokens_per_s=tokens / duration_s, requests_per_s=len(ok) / duration_s,
        ttft_ms=Summary.of(r.ttft_ms for r in ok), tpot_ms=Summary.of(r.tpot_ms for r in ok),
        itl_ms=Summary.of(x for r in ok for x in r.itls_ms), e2e_ms=Summary.of(r.e2e_ms for r in ok))


def _timeseries(records: Sequence[RequestRecord], samples: Sequence[tuple[float, Mapping[str, object]]],
                duration_s: float, bucket_s: float) -> TimeSeries:
    last = max([duration_s] + [t for r in records for t in r.chunk_times_s] + [t for t, _ in samples])
    n = max(1, math.ceil(last / bucket_s - 1e-9))
    tokens = {c.value: np.zeros(n) for c in RequestClass}
    for r in records:
        for t, k in zip(r.chunk_times_s, r.chunk_tokens):
            tokens[r.request_class.value][min(int(t // bucket_s), n - 1)] += k
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t, stats in samples:
        b = min(max(int(t // bucket_s), 0), n - 1)
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                sums.setdefault(key, np.zeros(n))[b] += value
                counts.setdefault(key, np.zeros(n))[b] += 1
    engine = {key: [float(s / c) if c else None for s, c in zip(v, counts[key])] for key, v in sorted(sums.items())}
    return TimeSeries(bucket_s, [i * bucket_s for i in range(n)],
                      {c: (v / bucket_s).tolist() for c, v in tokens.items()}, engine)
