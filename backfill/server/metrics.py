"""Prometheus metrics of one server: backfill's own series per request class, vLLM's set under
vLLM's names, HTTP status counters and the process' own, all in the app's registry.

Latencies are observed here, at the edge, from the TokenEvents each request receives (TTFT from
the request's arrival, TPOT as vLLM defines it: time after the first token / tokens after the
first; inter-token latency per event). Scheduler counters (preemptions, checkpointed / restored /
recomputed tokens, KV usage) are read from the engine when Prometheus scrapes, so nothing is
double-counted. Every per-model series carries `model_name` (vLLM's label), so one Prometheus
and one dashboard serve several models; vLLM's series carry `engine="0"` as vLLM's do.

Memory is bounded: every histogram is a set of counters updated as values arrive.
"""

from __future__ import annotations

import math
import platform
from typing import Callable, Iterable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from backfill.types import FinishReason, RequestClass
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.sequence import SeqStatus
from backfill.serving.stats import CumulativeHistogram

CLASSES = tuple(c.value for c in RequestClass)
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled")
# Why a request was refused with 429 (the error body's `code`).
REJECT_REASONS = ("queue_full", "slo_overload")
# Why offline work did not advance for a while (the live page and backfill_offline_stalled_seconds):
# online steps kept the device busy, KV blocks were all taken, there was none, a node's gate held
# it (docs/node.md), or none of those.
STALL_REASONS = ("online_saturates", "kv_full", "no_offline_work", "paused_by_node_gate", "other")
ENGINE_INDEX = "0"   # vLLM's `engine` label: one engine per server here
# vLLM's finished_reason values for backfill's finish reasons (a cancelled request is vLLM's "abort").
VLLM_FINISHED_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                        FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}


def geometric_buckets(low: float, high: float, per_decade: int = 26) -> tuple[float, ...]:
    """Upper bounds from low to high, each at most 10% above the one before (3 significant digits),
    so that histogram_quantile's interpolation inside a bucket is off by under 10%."""
    bounds, k = [], math.floor(per_decade * math.log10(low))
    while not bounds or bounds[-1] < high:
        bound = float(f"{10 ** (k / per_decade):.3g}")
        if bound >= low * 0.999:
            bounds.append(bound)
        k += 1
    return tuple(bounds)


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_tokens (vLLM's request-length buckets)."""
    bounds, mantissa, exponent = [], (1, 2, 5), 0
    while True:
        for m in mantissa:
            value = m * 10 ** exponent
            if value > max_tokens:
                return tuple(float(b) for b in bounds) or (1.0,)
            bounds.append(value)
        exponent += 1


# What the live page shows (online TTFT and TPOT, backfill's series): bounds at most 10% apart,
# from 1 ms (a GPU's TTFT) to 10 minutes (a CPU's under overload), 152 buckets, and from 0.1 ms
# (a GPU's decode step) to 30 s, 144 buckets.
LATENCY_BUCKETS_S = geometric_buckets(0.001, 600.0)
TOKEN_LATENCY_BUCKETS_S = geometric_buckets(0.0001, 30.0)
# vLLM's latency series, 26% apart (vLLM's own are coarser still): a tenth of the buckets above.
VLLM_LATENCY_BUCKETS_S = geometric_buckets(0.001, 600.0, per_decade=10)
VLLM_TOKEN_LATENCY_BUCKETS_S = geometric_buckets(0.0001, 30.0, per_decade=10)
# Whole requests and their phases, 58% apart: enough for a panel of means and rough quantiles,
# and a scrape stays small.
REQUEST_BUCKETS_S = geometric_buckets(0.001, 3600.0, per_decade=5)
HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ServerMetrics:
    """All metrics of one app, in the app's own registry (two apps in one process never clash)."""

    def __init__(self, engine: AsyncEngine, model_name: str, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None, version: str = "0.1.0") -> None:
        """ttft_slo_s / tpot_slo_s: the online SLOs, counted against in backfill_slo_requests_total."""
        # `*_created` series double the exposition and no dashboard reads them (process-wide switch,
        # as prometheus_client offers only that).
        disable_created_metrics()
        self.model_name = model_name
        self.slo_s = {"ttft": ttft_slo_s, "tpot": tpot_slo_s}
        self.batch_lines_in_flight: Callable[[], int] = lambda: 0   # set by the app once its worker exists
        self.backlog: Callable[[], tuple[int, dict[str, int]]] = lambda: (0, {})   # set by the app: the store
        self.damaged_reads: Callable[[], int] = lambda: 0   # set by the app: the store's refused reads
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        per_class = ["model_name", "class"]
        per_engine = ["model_name", "engine"]
        lengths = token_buckets(max(int(engine.max_model_len), 1))

        # backfill's own series, per request class
        self.ttft_s = Histogram("backfill_time_to_first_token_seconds", "Time to first token, per request class",
                                per_class, buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot_s = Histogram("backfill_time_per_output_token_seconds",
                                "Time per output token after the first, per request class", per_class,
                                buckets=TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.e2e_s = Histogram("backfill_e2e_request_latency_seconds",
                               "From a request's arrival to its last token (or its end), per request class",
                               per_class, buckets=REQUEST_BUCKETS_S, registry=r)
        self.queue_s = Histogram("backfill_request_queue_time_seconds",
                                 "From a request's arrival to the first step that runs it, per request class",
                                 per_class, buckets=REQUEST_BUCKETS_S, registry=r)
        self.prefill_s = Histogram("backfill_request_prefill_time_seconds",
                                   "From the first step that runs a request to its first token, per request class",
                                   per_class, buckets=REQUEST_BUCKETS_S, registry=r)
        self.decode_s = Histogram("backfill_request_decode_time_seconds",
                                  "From a request's first token to its last, per request class", per_class,
                                  buckets=REQUEST_BUCKETS_S, registry=r)
        self.prompt_len = Histogram("backfill_request_prompt_tokens", "Prompt length of requests, per class",
                                    per_class, buckets=lengths, registry=r)
        self.output_len = Histogram("backfill_request_generation_tokens", "Output length of finished requests "
                                    "(each choice), per class", per_class, buckets=lengths, registry=r)
        self.prompt_tokens = Counter("backfill_prompt_tokens", "Prompt tokens prefilled (counted at the first "
                                     "token), per class", per_class, registry=r)
        self.requests = Counter("backfill_requests", "Finished requests by class and finish reason",
                                [*per_class, "finish_reason"], registry=r)
        self.in_flight = Gauge("backfill_requests_in_flight", "Requests admitted and not yet finished",
                               per_class, registry=r)
        self.rejected = Counter("backfill_requests_rejected", "Requests refused with 429, by reason (queue_full: "
                                "too many in flight; slo_overload: predicted TTFT over the SLO)",
                                [*per_class, "reason"], registry=r)

        # vLLM's names (vLLM's published Grafana dashboards work unchanged), every class together
        self.vllm_ttft_s = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                     "seconds.", per_engine, buckets=VLLM_LATENCY_BUCKETS_S, registry=r)
        self.vllm_itl_s = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                    "seconds.", per_engine, buckets=VLLM_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.vllm_tpot_s = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                     "time_per_output_token_seconds per request.", per_engine,
                                     buckets=VLLM_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.vllm_e2e_s = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                    "seconds.", per_engine, buckets=REQUEST_BUCKETS_S, registry=r)
        self.vllm_queue_s = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                      "phase for request.", per_engine, buckets=REQUEST_BUCKETS_S, registry=r)
        self.vllm_inference_s = Histogram("vllm:request_inference_time_seconds", "Histogram of time spent in "
                                          "RUNNING phase for request.", per_engine, buckets=REQUEST_BUCKETS_S,
                                          registry=r)
        self.vllm_prefill_s = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                        "phase for request.", per_engine, buckets=REQUEST_BUCKETS_S, registry=r)
        self.vllm_decode_s = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE "
                                       "phase for request.", per_engine, buckets=REQUEST_BUCKETS_S, registry=r)
        self.vllm_prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                         per_engine, buckets=lengths, registry=r)
        self.vllm_output_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                         "processed.", per_engine, buckets=lengths, registry=r)
        self.vllm_max_tokens = Histogram("vllm:request_max_num_generation_tokens", "Histogram of maximum number "
                                         "of requested generation tokens.", per_engine, buckets=lengths, registry=r)
        self.vllm_params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens "
                                                "request parameter.", per_engine, buckets=lengths, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", per_engine,
                                          registry=r)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*per_engine, "finished_reason"], registry=r)

        self.slo_requests = Counter("backfill_slo_requests", "Requests by whether their TTFT / TPOT was within "
                                    "the SLO (attained true or false), per class: 1 - attained's share burns the "
                                    "error budget", [*per_class, "metric", "attained"], registry=r)
        self.offline_stalled_s = Counter("backfill_offline_stalled_seconds", "Time offline work did not advance "
                                         "(no offline token in a second), by why", ["model_name", "reason"],
                                         registry=r)

        self.http_requests = Counter("backfill_http_requests", "HTTP requests answered, by method, route and "
                                     "status code", ["method", "handler", "status"], registry=r)
        self.http_duration_s = Histogram("backfill_http_request_duration_seconds", "From an HTTP request's "
                                         "arrival to its response's end, by method and route",
                                         ["method", "handler"], buckets=HTTP_BUCKETS_S, registry=r)
        Info("backfill_build", "The server's version and platform", registry=r).info(
            {"version": version, "python": platform.python_version(), "model_name": model_name})

        m, e = model_name, ENGINE_INDEX
        for cls in CLASSES:  # export zeros from the start so dashboards see every series
            for family in (self.ttft_s, self.e2e_s, self.queue_s, self.prompt_tokens, self.tpot_s,
                           self.prefill_s, self.decode_s, self.prompt_len, self.output_len, self.in_flight):
                family.labels(m, cls)
            for reason in REJECT_REASONS:
                self.rejected.labels(m, cls, reason)
            for finish in FinishReason:
                self.requests.labels(m, cls, finish.value)
            for slo_metric, slo_s in self.slo_s.items():
                if slo_s is not None:
                    for attained in ("true", "false"):
                        self.slo_requests.labels(m, cls, slo_metric, attained)
        for family in (self.vllm_ttft_s, self.vllm_itl_s, self.vllm_tpot_s, self.vllm_e2e_s, self.vllm_queue_s,
                       self.vllm_inference_s, self.vllm_prefill_s, self.vllm_decode_s, self.vllm_prompt_len,
                       self.vllm_output_len, self.vllm_max_tokens, self.vllm_params_max_tokens,
                       self.vllm_prompt_tokens):
            family.labels(m, e)
        for reason in STALL_REASONS:
            self.offline_stalled_s.labels(m, reason)
        for finished in VLLM_FINISHED_REASON.values():
            self.vllm_success.labels(m, e, finished)
        self.registry.register(_EngineCollector(engine, self))
        # Observed per token event on the event loop: the labelled children resolved once (labels()
        # costs as much as an observation).
        self._itl_child = self.vllm_itl_s.labels(m, e)
        self._first_token_children = {cls: (self.ttft_s.labels(m, cls), self.prompt_tokens.labels(m, cls))
                                      for cls in CLASSES}
        self._vllm_first_token_children = (self.vllm_ttft_s.labels(m, e), self.vllm_prompt_tokens.labels(m, e))

    def observe_first_token(self, request_class: str, ttft_s: float, num_prompt_tokens: int) -> None:
        """The request's prompt is prefilled: its TTFT and its prompt tokens count now."""
        ttft_s = max(ttft_s, 0.0)
        ttft, prompt_tokens = self._first_token_children[request_class]
        ttft.observe(ttft_s)
        prompt_tokens.inc(num_prompt_tokens)
        vllm_ttft, vllm_prompt_tokens = self._vllm_first_token_children
        vllm_ttft.observe(ttft_s)
        vllm_prompt_tokens.inc(num_prompt_tokens)
        self._count_slo(request_class, "ttft", ttft_s)

    def _count_slo(self, request_class: str, slo_metric: str, seconds: float) -> None:
        slo_s = self.slo_s[slo_metric]
        if slo_s is not None:
            self.slo_requests.labels(self.model_name, request_class, slo_metric,
                                     "true" if seconds <= slo_s else "false").inc()

    def observe_token_gap(self, gap_s: float) -> None:
        """Between two token events of one request (vLLM's inter-token latency, every class)."""
        self._itl_child.observe(max(gap_s, 0.0))

    def observe_queued(self, request_class: str, queue_s: float) -> None:
        queue_s = max(queue_s, 0.0)
        self.queue_s.labels(self.model_name, request_class).observe(queue_s)
        self.vllm_queue_s.labels(self.model_name, ENGINE_INDEX).observe(queue_s)

    def observe_finish(self, request_class: str, reason: FinishReason | None, first_token_s: float | None,
                       last_token_s: float | None, num_output_tokens: int) -> None:
        """One choice finished (or was cancelled)."""
        reason = reason or FinishReason.CANCELLED
        m = self.model_name
        self.requests.labels(m, request_class, reason.value).inc()
        self.vllm_success.labels(m, ENGINE_INDEX, VLLM_FINISHED_REASON[reason]).inc()
        self.output_len.labels(m, request_class).observe(num_output_tokens)
        self.vllm_output_len.labels(m, ENGINE_INDEX).observe(num_output_tokens)
        if first_token_s is not None and last_token_s is not None and num_output_tokens > 1:
            tpot_s = (last_token_s - first_token_s) / (num_output_tokens - 1)
            self.tpot_s.labels(m, request_class).observe(tpot_s)
            self._count_slo(request_class, "tpot", tpot_s)
            self.vllm_tpot_s.labels(m, ENGINE_INDEX).observe(tpot_s)

    def observe_request(self, request_class: str, num_prompt_tokens: int, max_tokens: int, arrival_s: float,
                        scheduled_s: float | None, first_token_s: float | None, last_token_s: float | None,
                        ended_s: float) -> None:
        """Once per API request (its n choices share one prompt), with its phases' times (monotonic s)."""
        m, e = self.model_name, ENGINE_INDEX
        e2e_s = max(ended_s - arrival_s, 0.0)
        self.e2e_s.labels(m, request_class).observe(e2e_s)
        self.vllm_e2e_s.labels(m, e).observe(e2e_s)
        self.prompt_len.labels(m, request_class).observe(num_prompt_tokens)
        self.vllm_prompt_len.labels(m, e).observe(num_prompt_tokens)
        self.vllm_max_tokens.labels(m, e).observe(max_tokens)
        self.vllm_params_max_tokens.labels(m, e).observe(max_tokens)
        if scheduled_s is None:
            return
        self.vllm_inference_s.labels(m, e).observe(max((last_token_s or ended_s) - scheduled_s, 0.0))
        if first_token_s is not None:
            prefill_s = max(first_token_s - scheduled_s, 0.0)
            self.prefill_s.labels(m, request_class).observe(prefill_s)
            self.vllm_prefill_s.labels(m, e).observe(prefill_s)
            if last_token_s is not None:
                decode_s = max(last_token_s - first_token_s, 0.0)
                self.decode_s.labels(m, request_class).observe(decode_s)
                self.vllm_decode_s.labels(m, e).observe(decode_s)

    def observe_rejected(self, request_class: str, reason: str) -> None:
        self.rejected.labels(self.model_name, request_class, reason).inc()

    def observe_offline_stall(self, reason: str, seconds: float) -> None:
        self.offline_stalled_s.labels(self.model_name, reason).inc(seconds)

    def observe_http(self, method: str, handler: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(method, handler, str(status)).inc()
        self.http_duration_s.labels(method, handler).observe(max(duration_s, 0.0))

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
        engine = self.engine
        stats = engine.stats
        model = self.owner.model_name
        per_engine = [model, ENGINE_INDEX]
        waiting = {cls: 0 for cls in CLASSES}
        running = {cls: 0 for cls in CLASSES}
        for seq in engine.sequences():
            bucket = running if seq.status is SeqStatus.RUNNING else waiting
            bucket[seq.request_class.value] += 1
        queue = GaugeMetricFamily("backfill_queue_length", "Requests waiting for the device, per class",
                                  labels=["model_name", "class"])
        active = GaugeMetricFamily("backfill_running_requests", "Requests holding KV blocks, per class",
                                   labels=["model_name", "class"])
        tokens = CounterMetricFamily("backfill_output_tokens", "Output tokens generated, per class",
                                     labels=["model_name", "class"])
        # In prompt tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the hit rate.
        prefix_queries = CounterMetricFamily("backfill_prefix_cache_queries", "Prompt tokens looked up in the "
                                             "prefix cache at a request's first schedule, per class",
                                             labels=["model_name", "class"])
        prefix_hits = CounterMetricFamily("backfill_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                          "(their KV mapped, not computed), per class", labels=["model_name", "class"])
        for cls in CLASSES:
            queue.add_metric([model, cls], waiting[cls])
            active.add_metric([model, cls], running[cls])
            tokens.add_metric([model, cls], stats.output_tokens.get(cls, 0))
            prefix_queries.add_metric([model, cls], stats.prefix_cache_queries.get(cls, 0))
            prefix_hits.add_metric([model, cls], stats.prefix_cache_hits.get(cls, 0))
        yield queue
        yield active
        yield tokens
        yield prefix_queries
        yield prefix_hits
        kv_usage = engine.kv_usage
        yield _gauge("backfill_kv_cache_usage_ratio", "Fraction of KV blocks in use", ["model_name"], [model],
                     kv_usage)
        pool = engine.kv_pool
        cached_free = GaugeMetricFamily("backfill_prefix_cache_free_blocks", "Free KV blocks still holding a cached "
                                        "prefix, by eviction class (evicted in this order: offline, "
                                        "online_computed, online_reused)", labels=["model_name", "class"])
        for name, count in pool.num_cached_free_by_class.items():
            cached_free.add_metric([model, name], count)
        yield cached_free
        evictions = CounterMetricFamily("backfill_prefix_cache_evictions", "Cached KV blocks evicted to make room "
                                        "for new KV", labels=["model_name"])
        evictions.add_metric([model], pool.evictions)
        yield evictions
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                     ["model_name", "engine"], per_engine, sum(running.values()))
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     ["model_name", "engine"], per_engine, sum(waiting.values()))
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     ["model_name", "engine"], per_engine, kv_usage)
        yield _gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's earlier name). 1 means 100 percent usage.",
                     ["model_name", "engine"], per_engine, kv_usage)
        for name, help_text, counts in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 stats.prefix_cache_hits)):
            family = CounterMetricFamily(name, help_text, labels=["model_name", "engine"])
            family.add_metric(per_engine, sum(counts.values()))
            yield family
        generated = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.",
                                        labels=["model_name", "engine"])
        generated.add_metric(per_engine, sum(stats.output_tokens.values()))
        yield generated
        preempted = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                        labels=["model_name", "engine"])
        preempted.add_metric(per_engine, stats.preempted_requests)
        yield preempted
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
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        yield _histogram("backfill_preemption_latency_seconds",
                         "From an online arrival to the offline step yielding at a safepoint (ConServe §4.3)",
                         model, stats.preemption_latency_ms, 1e-3)
        yield CounterMetricFamily("backfill_store_damaged_reads", "Stored files and batch results refused because "
                                  "their SHA-256 no longer matched (damaged on disk)", value=self.owner.damaged_reads())
        yield _gauge("backfill_batch_lines_in_flight", "Batch API lines submitted to the engine", ["model_name"],
                     [model], self.owner.batch_lines_in_flight())
        try:
            lines_waiting, by_status = self.owner.backlog()
        except Exception:   # a failing store must not take /metrics down with it (/health reports it)
            return
        yield _gauge("backfill_batch_lines_waiting", "Batch API lines of in-progress batches not yet run (the "
                     "offline backlog)", ["model_name"], [model], lines_waiting)
        batches = GaugeMetricFamily("backfill_batches", "Batches by status", labels=["model_name", "status"])
        for status in BATCH_STATUSES:
            batches.add_metric([model, status], by_status.get(status, 0))
        yield batches


def _gauge(name: str, doc: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


def _histogram(name: str, doc: str, model: str, histogram: CumulativeHistogram,
               scale: float) -> HistogramMetricFamily:
    """A histogram the scheduler keeps (in its own unit; scale converts to seconds)."""
    cumulative = histogram.cumulative()
    buckets = [(f"{bound * scale:g}", count) for bound, count in zip(histogram.bounds, cumulative)]
    buckets.append(("+Inf", cumulative[-1]))
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], buckets, sum_value=histogram.total * scale)
    return family
