"""The live page of one server: GET /dashboard (static HTML + JS) polls GET /dashboard/data.

What an operator wants at a glance: online latency (P50/P99 TTFT and TPOT) against its SLOs,
online requests refused (429 by reason) against those served, offline tokens/s harvested and,
when offline work does not advance, why; the idle share online leaves (Valve §6's C_n), batches
and fine-tuning jobs advancing, over the last minutes.

Every number is computed from the same counters /metrics exposes, the way Prometheus would:
the change of a counter over the window, and percentiles by histogram_quantile's rule from the
change of a histogram's buckets. A sampler keeps one reading a second for the last
HISTORY_S; /dashboard/data reads the counters once more at request time, so its window ends now.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import Gauge, Histogram

from backfill.server.errors import bad_request
from backfill.server.metrics import CLASSES, REJECT_REASONS, STALL_REASONS
from backfill.server.static import dashboard_html
from backfill.serving.config import ServingConfig
from backfill.serving.sequence import SeqStatus

if TYPE_CHECKING:
    from backfill.server.state import ServerState

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 900.0          # the longest window a page may ask for
DEFAULT_WINDOW_S = 300.0
SERIES_STEP_S = 5.0        # one chart point per this many seconds
RECENT_BATCHES = 8
RECENT_JOBS = 5
# A second in which online steps kept the device this busy, or KV this full, explains offline
# work not advancing.
ONLINE_SATURATED_SHARE = 0.9
ONLINE_HELD_SHARE = 0.5
KV_FULL_USAGE = 0.95


@dataclass(frozen=True)
class Reading:
    """The counters the page charts, read at one instant (cumulative, as /metrics has them)."""

    t_s: float                                   # monotonic
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound s, cumulative count), +Inf last
    tpot_buckets: tuple[tuple[float, float], ...]
    online_requests: float
    offline_tokens: int
    online_tokens: int
    online_busy_s: float
    preemptions: int
    refused: tuple[float, ...] = ()      # online 429s so far, per REJECT_REASONS
    stalled_s: tuple[float, ...] = ()    # seconds offline work did not advance so far, per STALL_REASONS
    online_seqs: int = 0                 # online requests in the scheduler at that instant
    prefix_queries: tuple[int, ...] = ()  # prompt tokens looked up in the prefix cache, per CLASSES
    prefix_hits: tuple[int, ...] = ()     # of those, found cached, per CLASSES


def histogram_buckets(histogram: Histogram, request_class: str) -> tuple[tuple[float, float], ...]:
    """One class's cumulative buckets, as /metrics exposes them."""
    return tuple((float(sample.labels["le"]), sample.value)
                 for family in histogram.collect() for sample in family.samples
                 if sample.name.endswith("_bucket") and sample.labels.get("class") == request_class)


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear within
    the bucket the rank falls in (from 0 for the first), the last finite bound if it falls past it."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def bucket_delta(new: tuple[tuple[float, float], ...], old: tuple[tuple[float, float], ...]
                 ) -> tuple[tuple[float, float], ...]:
    return tuple((upper, count - was) for (upper, count), (_, was) in zip(new, old))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class DashboardSampler:
    """One Reading per SAMPLE_INTERVAL_S for the last HISTORY_S, on the server's event loop."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.readings: deque[Reading] = deque(maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S) + 2)
        self.stalled_s = {reason: 0.0 for reason in STALL_REASONS}
        self._task: asyncio.Task | None = None

    def read(self) -> Reading:
        metrics, stats = self.state.metrics, self.state.engine.stats
        online_requests = sum(sample.value for family in metrics.requests.collect() for sample in family.samples
                              if sample.name.endswith("_total") and sample.labels.get("class") == "online")
        refused = {sample.labels["reason"]: sample.value for family in metrics.rejected.collect()
                   for sample in family.samples
                   if sample.name.endswith("_total") and sample.labels.get("class") == "online"}
        return Reading(time.monotonic(), histogram_buckets(metrics.ttft_s, "online"),
                       histogram_buckets(metrics.tpot_s, "online"), online_requests,
                       stats.output_tokens.get("offline", 0), stats.output_tokens.get("online", 0),
                       stats.online_busy_s, stats.aborted_steps,
                       tuple(refused.get(reason, 0.0) for reason in REJECT_REASONS),
                       tuple(self.stalled_s[reason] for reason in STALL_REASONS),
                       sum(1 for seq in self.state.engine.sequences() if seq.request_class.value == "online"),
                       tuple(stats.prefix_cache_queries.get(cls, 0) for cls in CLASSES),
                       tuple(stats.prefix_cache_hits.get(cls, 0) for cls in CLASSES))

    def start(self) -> None:
        self.readings.append(self.read())
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stall_reason(self, previous: Reading, now: Reading, batch_lines_waiting: int) -> str | None:
        """Why offline work did not advance between two readings; None when it did."""
        if now.offline_tokens > previous.offline_tokens:
            return None
        offline_seqs = sum(1 for seq in self.state.engine.sequences() if seq.request_class.value == "offline")
        if not offline_seqs and not batch_lines_waiting and not self.state.worker.in_flight:
            return "no_offline_work"
        paused = self.state.offline_paused
        if paused is not None and paused():
            return "paused_by_node_gate"
        elapsed_s = max(now.t_s - previous.t_s, 1e-9)
        busy_share = (now.online_busy_s - previous.online_busy_s) / elapsed_s
        # Online steps filled the second, or online requests held the device from its start to its
        # end (the gaps between steps are the server's own overhead, not room for offline work).
        if busy_share >= ONLINE_SATURATED_SHARE or (previous.online_seqs and now.online_seqs
                                                    and busy_share >= ONLINE_HELD_SHARE):
            return "online_saturates"
        if self.state.engine.kv_usage >= KV_FULL_USAGE:
            return "kv_full"
        return "other"

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            try:   # the backlog is in the store (SQLite): read off the loop
                lines_waiting, _ = await asyncio.to_thread(self.state.store.backlog)
            except Exception:   # a failing store must not stop the page (/health reports it)
                lines_waiting = 0
            previous, reading = self.readings[-1], self.read()
            reason = self.stall_reason(previous, reading, lines_waiting)
            if reason is not None:
                elapsed_s = reading.t_s - previous.t_s
                self.stalled_s[reason] += elapsed_s
                self.state.metrics.observe_offline_stall(reason, elapsed_s)
                reading = replace(reading, stalled_s=tuple(self.stalled_s[r] for r in STALL_REASONS))
            self.readings.append(reading)

    def window(self, window_s: float) -> tuple[list[Reading], Reading]:
        """The readings of the last window_s (oldest first) and one taken now."""
        now = self.read()
        kept = [r for r in list(self.readings) if r.t_s >= now.t_s - window_s - SAMPLE_INTERVAL_S / 2]
        return kept or [now], now


def hit_rate(hits: float, queries: float) -> float | None:
    """hits / queries, as rate(prefix_cache_hits) / rate(prefix_cache_queries) reads it; None without queries."""
    return hits / queries if queries > 0 else None


def prefix_cache_summary(first: Reading, last: Reading) -> dict[str, Any]:
    """Prompt tokens looked up and found in the prefix cache over [first, last], in all and per class."""
    queries = {cls: new - old for cls, new, old in zip(CLASSES, last.prefix_queries, first.prefix_queries)}
    hits = {cls: new - old for cls, new, old in zip(CLASSES, last.prefix_hits, first.prefix_hits)}
    return {"queries": sum(queries.values()), "hits": sum(hits.values()),
            "hit_rate": hit_rate(sum(hits.values()), sum(queries.values())),
            "hit_rate_by_class": {cls: hit_rate(hits[cls], queries[cls]) for cls in queries}}


def summary(first: Reading, last: Reading) -> dict[str, Any]:
    """The page's numbers over [first, last], as Prometheus' increase() and histogram_quantile() give them."""
    duration_s = max(last.t_s - first.t_s, 1e-9)
    ttft, tpot = bucket_delta(last.ttft_buckets, first.ttft_buckets), bucket_delta(last.tpot_buckets,
                                                                                   first.tpot_buckets)
    offline_tokens = last.offline_tokens - first.offline_tokens
    return {"duration_s": duration_s,
            "ttft_p50_ms": ms(quantile(0.5, ttft)), "ttft_p99_ms": ms(quantile(0.99, ttft)),
            "tpot_p50_ms": ms(quantile(0.5, tpot)), "tpot_p99_ms": ms(quantile(0.99, tpot)),
            "online_requests": last.online_requests - first.online_requests,
            "online_tokens": last.online_tokens - first.online_tokens,
            "offline_tokens": offline_tokens, "offline_tokens_per_s": offline_tokens / duration_s,
            "idle_share": min(max(1.0 - (last.online_busy_s - first.online_busy_s) / duration_s, 0.0), 1.0),
            "preemptions": last.preemptions - first.preemptions,
            "prefix_cache": prefix_cache_summary(first, last),
            "refused": {reason: new - old for reason, new, old in zip(REJECT_REASONS, last.refused, first.refused)},
            "offline_stalled_share": {reason: min((new - old) / duration_s, 1.0)
                                      for reason, new, old in zip(STALL_REASONS, last.stalled_s, first.stalled_s)}}


def series(readings: list[Reading], now: Reading) -> list[dict[str, Any]]:
    """One point per SERIES_STEP_S: each the summary of the step before it (seconds relative to now)."""
    points, previous = [], None
    for reading in [*readings, now]:
        if previous is None or reading.t_s - previous.t_s >= SERIES_STEP_S or reading is now:
            if previous is not None and reading.t_s > previous.t_s:
                point = summary(previous, reading)
                points.append({"t_s": round(reading.t_s - now.t_s, 3),
                               **{k: point[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                        "tpot_p99_ms", "offline_tokens_per_s", "idle_share")},
                               "prefix_cache_hit_rate": point["prefix_cache"]["hit_rate"]})
            previous = reading
    return points


def batch_view(batch: dict) -> dict[str, Any]:
    counts = batch["request_counts"]
    return {"id": batch["id"], "status": batch["status"], "total": counts["total"],
            "completed": counts["completed"], "failed": counts["failed"], "created_at": batch["created_at"]}


def job_view(job: dict, steps: list[dict]) -> dict[str, Any]:
    last = steps[-1] if steps else {}
    return {"id": job["id"], "status": job["status"], "model": job["model"],
            "fine_tuned_model": job["fine_tuned_model"], "step": last.get("step", 0),
            "total_steps": last.get("total_steps"), "train_loss": last.get("train_loss"),
            "created_at": job["created_at"]}


def model_data(state: ServerState, sampler: DashboardSampler, window_s: float) -> dict[str, Any]:
    """The page's data of one model (its server); blocking (reads the store): call off the loop."""
    readings, now = sampler.window(window_s)
    waiting = {cls: 0 for cls in CLASSES}   # as backfill_queue_length / backfill_running_requests count
    running = {cls: 0 for cls in CLASSES}
    for seq in state.engine.sequences():
        bucket = running if seq.status is SeqStatus.RUNNING else waiting
        bucket[seq.request_class.value] += 1
    serving = state.config.serving or ServingConfig()
    batches, _ = state.store.list_batches(RECENT_BATCHES, None)
    jobs = state.fine_tuning.jobs
    recent_jobs, _ = jobs.list_jobs(RECENT_JOBS, None)
    lines_waiting, _ = state.store.backlog()
    return {"name": state.config.served_model_name or state.engine.model_name,
            "policy": serving.policy,
            "slo": {"ttft_ms": serving.coserve.slo.ttft_ms, "tpot_ms": serving.coserve.slo.tpot_ms},
            "window": summary(readings[0], now), "series": series(readings, now),
            "now": {"queue": waiting, "running": running, "kv_usage": state.engine.kv_usage,
                    "batch_lines_in_flight": state.worker.in_flight, "batch_lines_waiting": lines_waiting,
                    "draining": state.draining},
            "batches": [batch_view(b) for b in batches],
            "fine_tuning_jobs": [job_view(j, jobs.step_metrics(j["id"])) for j in recent_jobs]}


def window_param(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(f"window_s must be a number of seconds, got {raw!r}", param="window_s") from None
    if not SERIES_STEP_S <= value <= HISTORY_S:
        raise bad_request(f"window_s must be between {SERIES_STEP_S:g} and {HISTORY_S:g}, got {raw}",
                          param="window_s")
    return value


def add_dashboard_routes(app: FastAPI, state: ServerState) -> DashboardSampler:
    """GET /dashboard and GET /dashboard/data; the sampler is started and stopped with the app."""
    sampler = DashboardSampler(state)
    html = dashboard_html()
    # The SLOs the page draws its latencies against, for Grafana's panels too (deploy/grafana).
    slo = (state.config.serving or ServingConfig()).coserve.slo
    slo_s = Gauge("backfill_slo_seconds", "The online latency SLOs (ttft, tpot)", ["model_name", "metric"],
                  registry=state.metrics.registry)
    slo_s.labels(state.metrics.model_name, "ttft").set(slo.ttft_ms / 1e3)
    slo_s.labels(state.metrics.model_name, "tpot").set(slo.tpot_ms / 1e3)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> JSONResponse:
        window_s = window_param(request.query_params.get("window_s"))
        model = await asyncio.to_thread(model_data, state, sampler, window_s)
        return JSONResponse({"kind": "server", "window_s": window_s, "models": [model], "node": None},
                            headers={"Cache-Control": "no-store"})

    return sampler

