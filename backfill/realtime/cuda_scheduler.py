"""REEF on a CUDA device (§3-§4): RT and BE work on separate streams with stream priorities.

The same loop and modes as the portable scheduler (task_scheduler.py), with a GPU's streams in place of
worker processes:
  - RT requests run on one stream of the device's highest priority, BE streams on the lowest
    (REEF §3's stream priority: the GPU's block scheduler serves the RT stream's blocks first);
  - each BE stream launches through a LaunchWindow (launch_window.py): at most `inflight_capacity`
    ops in flight, each with a CUDA event, so an RT arrival waits for at most that window;
  - preemption drops every BE stream's queued launches; what is in flight completes (CUDA cannot
    recall a launched kernel through its public API, so no reset: the window is the bound) and
    the stream restores after it (with a reset it would restore from the idempotent group's entry,
    §4.4; the window logic supports both and is tested on the CPU).
Modes: reef (priorities, window, preemption), seq (one request on the device at a time, never
preempted), concurrent (every stream at one priority, deep queues, no preemption), rt-only.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from backfill.errors import RealtimeError
from backfill.realtime.config import DEEP_QUEUE, TaskSchedulerConfig
from backfill.realtime.launch_window import LaunchWindow
from backfill.realtime.models import Workspace
from backfill.realtime.task_scheduler import ArrivalSource, Preemption, QueueScheduler, Request, ServedModel

CUDA_MODES = ("reef", "seq", "concurrent", "rt-only")


def profile_on_device(served: ServedModel, runs: int = 5) -> ServedModel:
    """The model's standalone time on its device (synchronised), the DISB normaliser."""
    model = served.model
    ws = model.workspace()
    ws.set_input(model.example_input)
    model.run(ws)
    torch.cuda.synchronize()
    totals = []
    for _ in range(runs):
        start = time.perf_counter()
        model.run(ws)
        torch.cuda.synchronize()
        totals.append(time.perf_counter() - start)
    totals.sort()
    return ServedModel(model, served.imap, served.op_s, totals[len(totals) // 2])


@dataclass
class _BEStream:
    served: ServedModel
    stream: torch.cuda.Stream
    ws: Workspace
    window: LaunchWindow
    queue: deque = field(default_factory=deque)
    current: Request | None = None


class CudaScheduler(QueueScheduler):
    """REEF §3's loop with a GPU's streams; it busy-polls between arrivals (no _wait)."""

    def __init__(self, config: TaskSchedulerConfig, models: dict[str, ServedModel], be_streams: dict[str, str]) -> None:
        if config.mode not in CUDA_MODES:
            raise RealtimeError(f"mode {config.mode!r} has no CUDA form; choose {', '.join(CUDA_MODES)}")
        if config.pad:
            raise RealtimeError("§5 padding has no CUDA form here (it needs kernel-level occupancy control)")
        self.config = config
        self.models = models
        low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): larger is lower
        prioritised = config.mode in ("reef", "rt-only")
        self.rt_stream = torch.cuda.Stream(priority=high if prioritised else low)
        capacity = config.inflight_capacity if config.mode == "reef" else DEEP_QUEUE
        self.streams: dict[str, _BEStream] = {}
        for name, model in ({} if config.mode == "rt-only" else be_streams).items():
            served = self._served(model)
            stream = torch.cuda.Stream(priority=low)
            ws = served.model.workspace()
            self.streams[name] = _BEStream(served, stream, ws, LaunchWindow(capacity, self._launcher(stream, ws),
                                                                             served.imap))
        self.rt_ws: dict[str, Workspace] = {}
        self.rt_queue: deque[Request] = deque()
        self.completed: list[Request] = []
        self.preemptions: list[Preemption] = []
        self.padded_ops = 0

    @staticmethod
    def _launcher(stream: torch.cuda.Stream, ws: Workspace):
        def launch(op: int):
            with torch.cuda.stream(stream):
                ws.run_op(op)
                event = torch.cuda.Event()
                event.record(stream)
            return event
        return launch

    def close(self) -> None:
        torch.cuda.synchronize()
        self.streams.clear()

    def service_be(self, source: ArrivalSource) -> None:
        seq = self.config.mode == "seq"
        if seq and any(s.current is not None for s in self.streams.values()):
            for s in self.streams.values():
                self._check_done(s, source)
            return
        for s in self.streams.values():
            self._check_done(s, source)
            if s.window.preempted is not None and not s.window.restore():
                continue
            if s.current is None and s.queue:
                req = s.queue.popleft()
                req.start_s = time.perf_counter()
                with torch.cuda.stream(s.stream):
                    s.ws.set_input(req.x)
                s.current = req
                s.window.begin(len(s.served.model))
                s.window.top_up()
                if seq:
                    break
            s.window.top_up()

    def _check_done(self, s: _BEStream, source: ArrivalSource) -> None:
        if s.current is None or not s.window.done:
            return
        req = s.current
        req.finish_s = time.perf_counter()
        s.current = None
        self.completed.append(req)
        source.on_complete(req, req.finish_s)

    def _realtime_mode(self, source: ArrivalSource) -> None:
        mode = self.config.mode
        if mode == "seq":  # the BE request on the device runs to its end first
            while any(s.current is not None for s in self.streams.values()):
                for s in self.streams.values():
                    s.window.top_up()
                    self._check_done(s, source)
        elif mode == "reef":
            self.preempt_all(self.rt_queue[0])
        while self.rt_queue:
            self._run_rt(self.rt_queue.popleft(), source)
            for r in source.due(time.perf_counter()):
                self.submit(r)

    def preempt_all(self, trigger: Request) -> None:
        t0 = time.perf_counter()
        active = [s for s in self.streams.values() if s.current is not None and s.window.preempted is None]
        if not active:
            return
        waited = False
        for s in active:
            s.current.preemptions += 1
            waited |= bool(s.window.preempt(reset=False).in_flight)
        t1 = time.perf_counter()
        self.preemptions.append(Preemption("drop" if waited else "idle", t1 - trigger.arrival_s, t1 - t0, len(active)))

    def _run_rt(self, req: Request, source: ArrivalSource) -> None:
        served = self._served(req.model)
        ws = self.rt_ws.get(req.model)
        if ws is None:
            ws = self.rt_ws[req.model] = served.model.workspace()
        req.start_s = time.perf_counter()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.rt_stream):
            ws.set_input(req.x)
            for i in range(len(served.model)):
                if self.config.mode == "concurrent":
                    self.service_be(source)
                ws.run_op(i)
            done.record(self.rt_stream)
        while not done.query():  # busy-poll, as REEF's scheduler does
            if self.config.mode == "concurrent":
                self.service_be(source)
        req.finish_s = time.perf_counter()
        req.output = ws.output()
        self.completed.append(req)
        source.on_complete(req, req.finish_s)


__all__ = ["CUDA_MODES", "CudaScheduler", "profile_on_device"]
