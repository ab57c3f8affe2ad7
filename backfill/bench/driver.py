"""The load driver: open-loop timed requests plus closed-loop offline backlogs against one Target.

Open loop: request i is sent at t0 + arrival_s[i] whatever the target does (each is its own task),
with sleeps aimed at absolute times so a late wake-up never pushes later requests back; the
difference between the actual and the scheduled send time is the send lag, reported so a
saturated client is visible rather than silently turning the run into a closed loop.

Closed loop: each OfflineBacklog keeps `concurrency` requests outstanding, taking the next from
its pool when one finishes, from t0 until the run ends: when every open-loop request has finished
and at least `workload.duration_s` has passed. Offline requests still running then are cancelled
(records marked `cancelled`) unless drain_offline is set.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from backfill.progress import PROGRESS_EVERY_S
from backfill.bench.metrics import RequestRecord
from backfill.bench.target import StatsSource, Target
from backfill.bench.workload import BenchRequest, OfflineBacklog, Workload
from backfill.errors import WorkloadError


@dataclass
class RunResult:
    records: list[RequestRecord]                                   # sorted by send time
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (t_s, target stats)
    duration_s: float = 0.0          # when the run ended (online done and workload.duration_s passed)
    started_unix_s: float = 0.0      # wall clock of t0, for labelling only
    t0_monotonic_s: float = 0.0      # time.monotonic() of t0: subtract it from engine event times
    backlog_exhausted: bool = False  # some backlog ran out of requests before the end
    sample_error: str | None = None  # why stats sampling stopped early, if it did
    cut_short: bool = False          # max_duration_s passed: open-loop requests still running were cancelled


async def run_workload(target: Target, workload: Workload, *, progress: bool = True,
                       sample_interval_s: float | None = 1.0, drain_offline: bool = False,
                       start_delay_s: float = 0.05, max_duration_s: float | None = None) -> RunResult:
    """Drive `workload` against `target`; times in the records are seconds since t0. The target's
    gauges are sampled every sample_interval_s where it has them (None: never; reading a server's
    /metrics costs CPU on both sides, which a run measuring the server's own cost must not add).
    max_duration_s bounds the run: open-loop requests still running then are cancelled (their
    records marked `cancelled`) and the result says `cut_short`, so a benchmark ends when it said."""
    if not isinstance(target, Target):
        raise WorkloadError(f"{type(target).__name__} is not a benchmark Target (it needs generate())")
    if (sample_interval_s is not None and sample_interval_s <= 0) or start_delay_s < 0:
        raise WorkloadError("sample_interval_s must be > 0 and start_delay_s >= 0")
    if max_duration_s is not None and not max_duration_s > 0:
        raise WorkloadError(f"max_duration_s must be > 0, got {max_duration_s}")
    run = _Run(target, workload, progress, drain_offline)
    return await run.go(sample_interval_s, start_delay_s, max_duration_s)


class _Run:
    def __init__(self, target: Target, workload: Workload, progress: bool, drain_offline: bool) -> None:
        self.target = target
        self.workload = workload
        self.drain_offline = drain_offline
        self.records: list[RequestRecord] = []
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.sample_error: str | None = None
        self.exhausted = False
        self.stop = asyncio.Event()
        self.t0 = 0.0
        self.offline_done = 0
        self.open_tasks: list[asyncio.Task] = []
        self.cut_short = False
        total = len(workload.requests) or None
        self.bar = tqdm(total=total, desc="online" if workload.online else "requests", unit="req",
                        disable=not progress, dynamic_ncols=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def go(self, sample_interval_s: float | None, start_delay_s: float,
                 max_duration_s: float | None = None) -> RunResult:
        self.t0 = time.monotonic() + start_delay_s
        started_unix_s = time.time() + start_delay_s
        backlogs = [asyncio.create_task(self._backlog(b)) for b in self.workload.offline_backlogs]
        sampler = (asyncio.create_task(self._sample(sample_interval_s))
                   if sample_interval_s is not None and isinstance(self.target, StatsSource) else None)
        refresher = asyncio.create_task(self._refresh_bar()) if not self.bar.disable else None
        try:
            if max_duration_s is None:
                await self._open_loop()
            else:
                await self._bounded_open_loop(start_delay_s + max_duration_s)
            if self.workload.duration_s is not None:
                await _sleep_until(self.t0 + self.workload.duration_s)
            end_s = self.now()
            self.stop.set()
            if not self.drain_offline:
                for task in backlogs:
                    task.cancel()
            await asyncio.gather(*backlogs, return_exceptions=True)
        finally:
            self.stop.set()
            for task in backlogs:
                task.cancel()
            for task in (sampler, refresher):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            self.bar.close()
        records = sorted(self.records, key=lambda r: (r.send_s is None, r.send_s or 0.0))
        return RunResult(records, self.samples, end_s, started_unix_s, self.t0, self.exhausted, self.sample_error,
                         self.cut_short)

    async def _refresh_bar(self) -> None:
        """Redraw the bar (its elapsed time) while no request finishes: a user never watches it frozen."""
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self.bar.refresh()

    async def _open_loop(self) -> None:
        for req in self.workload.requests:
            await _sleep_until(self.t0 + req.arrival_s)
            rec = self._record(req)
            self.open_tasks.append(asyncio.create_task(self._send(req, rec, open_loop=True)))
        await asyncio.gather(*self.open_tasks)

    async def _bounded_open_loop(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._open_loop(), timeout_s)
        except asyncio.TimeoutError:
            self.cut_short = True
            for task in self.open_tasks:   # those sent before the cut and still running
                task.cancel()
            await asyncio.gather(*self.open_tasks, return_exceptions=True)

    async def _backlog(self, backlog: OfflineBacklog) -> None:
        await _sleep_until(self.t0)
        pool = iter(backlog.requests)

        async def loop() -> None:
            for req in pool:  # one iterator shared by the workers: each request is sent once
                if self.stop.is_set():
                    return
                await self._send(req, self._record(req), open_loop=False)
            if not self.stop.is_set():
                self.exhausted = True

        await asyncio.gather(*(loop() for _ in range(backlog.concurrency)))

    def _record(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(req.request_id, req.request_class, req.client, scheduled_s=req.arrival_s,
                            prompt_tokens=req.prompt_tokens)
        self.records.append(rec)
        return rec

    async def _send(self, req: BenchRequest, rec: RequestRecord, *, open_loop: bool) -> None:
        rec.send_s = self.now()
        try:
            async for chunk in self.target.generate(req):
                if chunk.prompt_tokens is not None:
                    rec.prompt_tokens = int(chunk.prompt_tokens)
                if chunk.num_preemptions is not None:
                    rec.num_preemptions = int(chunk.num_preemptions)
                if chunk.num_tokens > 0:
                    t = chunk.time_s - self.t0
                    if rec.first_token_s is None:
                        rec.first_token_s = t
                    rec.chunk_times_s.append(t)
                    rec.chunk_tokens.append(int(chunk.num_tokens))
                    rec.output_tokens += int(chunk.num_tokens)
            rec.end_s = self.now()
            if rec.output_tokens == 0:
                rec.error = "the stream ended without any output token"
        except asyncio.CancelledError:
            rec.cancelled = True
            rec.end_s = self.now()
            raise
        except Exception as exc:  # a benchmark records a failed request and carries on
            rec.error = f"{type(exc).__name__}: {exc}"
            rec.end_s = self.now()
        finally:
            if open_loop:
                self.bar.update(1)
            else:
                self.offline_done += 1
                self.bar.set_postfix(offline=self.offline_done, refresh=False)

    async def _sample(self, interval_s: float) -> None:
        await _sleep_until(self.t0)
        k = 0
        # Ends on `stop` as well as on cancellation: Python 3.11's asyncio.wait_for (inside the
        # client's GET) can swallow a cancellation that lands as its read completes, and a sampler
        # that went on sampling would keep the run from ever returning.
        while not self.stop.is_set():
            try:
                stats = await self.target.sample_stats()
            except Exception as exc:  # stats are an extra; a failing endpoint must not end the run
                self.sample_error = f"{type(exc).__name__}: {exc}"
                return
            self.samples.append((self.now(), dict(stats)))
            k += 1
            await _sleep_until(self.t0 + k * interval_s)


async def _sleep_until(deadline_monotonic: float) -> None:
    delay = deadline_monotonic - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
