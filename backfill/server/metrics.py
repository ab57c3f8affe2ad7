"""Prometheus metrics of one server: latency histograms per class plus the scheduler's counters.

Latencies are observed here, at the edge, from the TokenEvents each request receives (TTFT from
the request's arrival, TPOT as vLLM defines it: time after the first token / tokens after the
first). Scheduler counters (preemptions, checkpointed / restored / recomputed tokens, KV usage)
are read from the engine when Prometheus scrapes, so nothing is double-counted.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from backfill.types import FinishReason, RequestClass
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.sequence import SeqStatus

CLASSES = tuple(c.value for c in RequestClass)
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled")
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_PREEMPT_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TPOT_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    """All metrics of one app, in the app's own registry (two apps in one process never clash)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.batch_lines_in_flight: Callable[[], int] = lambda: 0   # set by the app once its worker exists
        self.backlog: Callable[[], tuple[int, dict[str, int]]] = lambda: (0, {})   # set by the app: the store
        self.damaged_reads: Callable[[], int] = lambda: 0   # set by the app: the store's refused reads
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft_s = Histogram("backfill_time_to_first_token_seconds", "Time to first token, per request class",
                                ["class"], buckets=_TTFT_BUCKETS_S, registry=self.registry)
        self.tpot_s = Histogram("backfill_time_per_output_token_seconds",
                                "Time per output token after the first, per request class", ["class"],
                                buckets=_TPOT_BUCKETS_S, registry=self.registry)
        self.e2e_s = Histogram("backfill_e2e_request_latency_seconds",
                               "From a request's arrival to its last token (or its end), per request class",
                               ["class"], buckets=_E2E_BUCKETS_S, registry=self.registry)
        self.queue_s = Histogram("backfill_request_queue_time_seconds",
                                 "From a request's arrival to the first step that runs it, per request class",
                                 ["class"], buckets=_TTFT_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter("backfill_prompt_tokens", "Prompt tokens of finished requests, per class",
                                     ["class"], registry=self.registry)
        self.requests = Counter("backfill_requests", "Finished requests by class and finish reason",
                                ["class", "finish_reason"], registry=self.registry)
        self.in_flight = Gauge("backfill_requests_in_flight", "Requests admitted and not yet finished",
                               ["class"], registry=self.registry)
        self.rejected = Counter("backfill_requests_rejected", "Requests refused with 429 (queue full or "
                                "predicted TTFT over the SLO)",
                                ["class"], registry=self.registry)
        for cls in CLASSES:  # export zeros from the start so dashboards see every series
            self.ttft_s.labels(cls)
            self.e2e_s.labels(cls)
            self.queue_s.labels(cls)
            self.prompt_tokens.labels(cls)
            self.tpot_s.labels(cls)
            self.in_flight.labels(cls)
            self.rejected.labels(cls)
            for reason in FinishReason:
                self.requests.labels(cls, reason.value)
        self.registry.register(_EngineCollector(engine, self))

    def observe_first_token(self, request_class: str, ttft_s: float) -> None:
        self.ttft_s.labels(request_class).observe(max(ttft_s, 0.0))

    def observe_finish(self, request_class: str, reason: FinishReason | None, first_token_s: float | None,
                       last_token_s: float | None, num_output_tokens: int) -> None:
        self.requests.labels(request_class, (reason or FinishReason.CANCELLED).value).inc()
        if first_token_s is not None and last_token_s is not None and num_output_tokens > 1:
            self.tpot_s.labels(request_class).observe((last_token_s - first_token_s) / (num_output_tokens - 1))

    def observe_request(self, request_class: str, num_prompt_tokens: int, e2e_s: float) -> None:
        """Once per API request (its n choices share one prompt)."""
        self.prompt_tokens.labels(request_class).inc(num_prompt_tokens)
        self.e2e_s.labels(request_class).observe(max(e2e_s, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the scheduler's state at scrape time."""

    def __init__(self, engine: AsyncEngine, owner: ServerMetrics) -> None:
        self.engine = engine
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        scheduler = self.engine.scheduler
        stats = scheduler.stats
        waiting = {cls: 0 for cls in CLASSES}
        running = {cls: 0 for cls in CLASSES}
        # list() copies the dict in one C call under the GIL, so the scheduler thread cannot
        # resize it mid-iteration.
        for seq in list(scheduler.seqs.values()):
            bucket = running if seq.status is SeqStatus.RUNNING else waiting
            bucket[seq.request_class.value] += 1
        queue = GaugeMetricFamily("backfill_queue_length", "Requests waiting for the device, per class",
                                  labels=["class"])
        active = GaugeMetricFamily("backfill_running_requests", "Requests holding KV blocks, per class",
                                   labels=["class"])
        tokens = CounterMetricFamily("backfill_output_tokens", "Output tokens generated, per class",
                                     labels=["class"])
        # In prompt tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the hit rate.
        prefix_queries = CounterMetricFamily("backfill_prefix_cache_queries", "Prompt tokens looked up in the "
                                             "prefix cache at a request's first schedule, per class", labels=["class"])
        prefix_hits = CounterMetricFamily("backfill_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                          "(their KV mapped, not computed), per class", labels=["class"])
        for cls in CLASSES:
            queue.add_metric([cls], waiting[cls])
            active.add_metric([cls], running[cls])
            tokens.add_metric([cls], stats.output_tokens.get(cls, 0))
            prefix_queries.add_metric([cls], stats.prefix_cache_queries.get(cls, 0))
            prefix_hits.add_metric([cls], stats.prefix_cache_hits.get(cls, 0))
        yield queue
        yield active
        yield tokens
        yield prefix_queries
        yield prefix_hits
        yield GaugeMetricFamily("backfill_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                                value=scheduler.kv.usage)
        counters = (
            ("backfill_scheduler_steps", "Engine steps run", stats.steps),
            ("backfill_preemptions", "Steps aborted at a layer safepoint for an online arrival (ConServe §4.3)",
             stats.aborted_steps),
            ("backfill_preempted_requests", "Requests taken off the device to free KV blocks",
             stats.preempted_requests),
            ("backfill_checkpointed_tokens", "Tokens of KV copied to host checkpoints (ConServe §4.4)",
             stats.checkpointed_tokens),
            ("backfill_restored_tokens", "Tokens of KV restored from host checkpoints", stats.restored_tokens),
            ("backfill_recomputed_tokens", "Tokens of KV recomputed after preemption", stats.recomputed_tokens),
            ("backfill_resumed_steps", "Aborted steps continued from their safepoint", stats.resumed_steps),
            ("backfill_wasted_tokens", "Tokens of aborted steps that were redone", stats.wasted_tokens),
            ("backfill_online_busy_seconds", "Time in steps that carried online tokens (1 - its rate: the idle "
             "share left for offline work, Valve §6)", stats.online_busy_s),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield _histogram("backfill_preemption_latency_seconds",
                         "From an online arrival to the offline step yielding at a safepoint (ConServe §4.3)",
                         [ms / 1e3 for ms in list(stats.preemption_latencies_ms)], _PREEMPT_BUCKETS_S)
        yield CounterMetricFamily("backfill_store_damaged_reads", "Stored files and batch results refused because "
                                  "their SHA-256 no longer matched (damaged on disk)", value=self.owner.damaged_reads())
        yield GaugeMetricFamily("backfill_batch_lines_in_flight", "Batch API lines submitted to the engine",
                                value=self.owner.batch_lines_in_flight())
        try:
            waiting, by_status = self.owner.backlog()
        except Exception:   # a failing store must not take /metrics down with it (/health reports it)
            return
        yield GaugeMetricFamily("backfill_batch_lines_waiting", "Batch API lines of in-progress batches not yet "
                                "run (the offline backlog)", value=waiting)
        batches = GaugeMetricFamily("backfill_batches", "Batches by status", labels=["status"])
        for status in BATCH_STATUSES:
            batches.add_metric([status], by_status.get(status, 0))
        yield batches


def _histogram(name: str, doc: str, values: list[float], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(1 for v in values if v <= bound)) for bound in bounds]
    buckets.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))
