"""REEF's task queues and scheduler (§3), reset-based preemption and restore (§4), padding (§5).

One real-time (RT) queue and one best-effort (BE) queue per BE stream, each FIFO. RT requests run
one at a time in the scheduler's own process; each BE stream has a worker process (`worker.py`)
fed from the stream's host queue through a bounded in-flight queue. The scheduler polls its queues
and switches between two modes:

- normal mode (RT queue empty): every BE stream restores what was preempted, starts its next
  request and keeps its in-flight queue topped up;
- real-time mode: preempt every BE stream (drop its host queue, set its eviction flag, wait for or
  kill the op it is running), then run the RT request op by op, optionally padding BE ops into the
  cores the RT op leaves idle (§5), and back to normal mode when the RT queue is empty.

The baselines of REEF §6.2 are other modes of the same loop: `seq` runs one request at a time and
never preempts (an RT request waits for the BE request in progress), `concurrent` runs everything
at once without priorities (GPU streams; here OS time-sharing of processes), `rt-only` is `reef`
with no BE clients.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from backfill.errors import RealtimeError
from backfill.realtime.idempotence import IdempotenceMap
from backfill.realtime.models import OpModel, Workspace
from backfill.realtime.config import DEEP_QUEUE, MODES, PREEMPT_PATHS, TaskSchedulerConfig  # noqa: F401 (re-exported)
from backfill.realtime.worker import BEWorker





@dataclass
class ServedModel:
    """A model with its idempotence map and per-op profile (seconds), measured solo."""

    model: OpModel
    imap: IdempotenceMap
    op_s: np.ndarray
    solo_s: float

    @property
    def name(self) -> str:
        return self.model.name


def profile(model: OpModel, imap: IdempotenceMap, runs: int = 3) -> ServedModel:
    ws = model.workspace()
    ws.set_input(model.example_input)
    model.run(ws)  # warm-up
    per_op = np.zeros((runs, len(model)))
    totals = []
    for r in range(runs):
        start = time.perf_counter()
        for i in range(len(model)):
            t = time.perf_counter()
            ws.run_op(i)
            per_op[r, i] = time.perf_counter() - t
        totals.append(time.perf_counter() - start)
    return ServedModel(model, imap, np.median(per_op, axis=0), float(np.median(totals)))


@dataclass
class Request:
    client: str
    model: str
    realtime: bool
    x: torch.Tensor
    arrival_s: float
    start_s: float | None = None
    finish_s: float | None = None
    output: torch.Tensor | None = None
    preemptions: int = 0
    reexecuted_ops: int = 0
    reexecuted_s: float = 0.0    # profiled time of the re-executed ops: BE work a kill throws away

    @property
    def latency_s(self) -> float:
        return (self.finish_s or float("nan")) - self.arrival_s


@dataclass
class Preemption:
    path: str                # "idle" (nothing running), "evict" (waited for the op) or "kill"
    from_arrival_s: float    # RT arrival -> BE stopped
    from_signal_s: float     # preemption call -> BE stopped
    streams: int


class ArrivalSource(Protocol):
    def due(self, now_s: float) -> list[Request]: ...
    def next_s(self) -> float: ...
    def on_complete(self, request: Request, now_s: float) -> None: ...


def _may_raise(levels: int) -> bool:
    """Whether this process may raise its own priority by `levels` (needs CAP_SYS_NICE); undone at once."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if levels <= 0 or base - levels < -20:
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, 0, base - levels)
    except PermissionError:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, base)
    return True


@dataclass
class _Stream:
    """A BE queue and the worker process that serves it (a GPU stream in REEF)."""

    served: ServedModel
    worker: BEWorker
    queue: deque = field(default_factory=deque)
    current: Request | None = None
    host_queue: deque = field(default_factory=deque)
    preempted: bool = False
    killed_op: int = -1


class QueueScheduler:
    """What both REEF schedulers share (§3): the served models, one RT queue and a BE queue per
    stream, and the loop that takes arrivals and switches between real-time and normal mode.
    Subclasses hold `streams` (name -> an object with a `queue`) and run the two modes."""

    config: TaskSchedulerConfig
    models: dict[str, ServedModel]
    streams: dict
    rt_queue: deque

    def _served(self, model: str) -> ServedModel:
        if model not in self.models:
            raise RealtimeError(f"no served model {model!r}; have {sorted(self.models)}")
        return self.models[model]

    def submit(self, request: Request) -> None:
        self._served(request.model)
        if request.realtime:
            self.rt_queue.append(request)
        elif self.config.mode != "rt-only":
            if request.client not in self.streams:
                raise RealtimeError(f"no BE stream {request.client!r}")
            self.streams[request.client].queue.append(request)

    def run(self, source: ArrivalSource, until_s: float) -> None:
        """Serve until `until_s` (time.perf_counter() clock); RT requests that arrived by then are
        still served, BE work left over is dropped."""
        while True:
            now = time.perf_counter()
            for r in source.due(min(now, until_s)):
                self.submit(r)
            if now >= until_s and not self.rt_queue:
                break
            if self.rt_queue:
                self._realtime_mode(source)
                continue
            self.service_be(source)
            self._wait(min(source.next_s(), until_s) - time.perf_counter())

    def _wait(self, timeout_s: float) -> None:
        """Between polls when nothing is due; REEF §3 busy-polls (the default)."""

    def service_be(self, source: ArrivalSource) -> None:
        raise NotImplementedError

    def _realtime_mode(self, source: ArrivalSource) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RealtimeScheduler(QueueScheduler):
    def __init__(self, config: TaskSchedulerConfig, models: dict[str, ServedModel],
                 be_streams: dict[str, str]) -> None:
        """be_streams: BE client (one queue and worker each) -> its model."""
        self.config = config
        self.models = models
        capacity = config.inflight_capacity if config.mode == "reef" else DEEP_QUEUE
        self._progress = __import__("multiprocessing").get_context("fork").Semaphore(0)
        self._cores = sorted(os.sched_getaffinity(0))
        if config.pad and len(self._cores) < config.cores:
            raise RealtimeError(f"pad needs {config.cores} cores, this process may use {len(self._cores)}")
        self._cores = self._cores[:config.cores]
        self.streams: dict[str, _Stream] = {}
        # Stream priority (REEF §3): the scheduler, which runs RT ops, sits be_nice levels above BE
        # work. It is raised where permitted rather than BE lowered, so that BE keeps the standing
        # the baselines' BE has against other jobs on a shared machine; RT-only (REEF without BE)
        # is raised alike. The baselines have no priorities.
        self._base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._raise = config.be_nice if config.mode in ("reef", "rt-only") and _may_raise(config.be_nice) else 0
        for name, model in ({} if config.mode == "rt-only" else be_streams).items():
            served = self._served(model)
            nice = config.be_nice - self._raise if config.mode == "reef" else 0
            self.streams[name] = _Stream(served, BEWorker(served.model, capacity, self._progress, nice))
        if self._raise:  # after the fork servers are forked, so they and their workers stay at BE's level
            os.setpriority(os.PRIO_PROCESS, 0, self._base_nice - self._raise)
        self.rt_queue: deque[Request] = deque()
        self.rt_ws: dict[str, Workspace] = {}
        self.completed: list[Request] = []
        self.preemptions: list[Preemption] = []
        self.padded_ops = 0
        self._pad_next = 0
        torch.set_num_threads(config.rt_threads)

    def close(self) -> None:
        for s in self.streams.values():
            s.worker.close()
        self.streams.clear()
        if self._raise:
            os.setpriority(os.PRIO_PROCESS, 0, self._base_nice)
            self._raise = 0

    # -- the loop -------------------------------------------------------------------------------

    def _wait(self, timeout_s: float) -> None:
        # REEF §3 busy-polls; here the loop sleeps and spins only for the last spin_ms before the
        # next RT arrival, so a sleeping wake-up (late on a loaded machine) never delays one. Every
        # mode, RT-only included, gets the same margin.
        spin_s = self.config.spin_ms / 1e3
        if timeout_s <= spin_s or self.config.busy_poll:
            return
        if not self.streams:
            time.sleep(timeout_s - spin_s)  # nothing to poll but the clock
            return
        self._progress.acquire(timeout=min(timeout_s - spin_s, 0.005))

    # -- normal mode ----------------------------------------------------------------------------

    def service_be(self, source: ArrivalSource) -> None:
        """Normal mode, one pass: finish, restore, start and top up every BE stream."""
        mode = self.config.mode
        if mode == "seq" and any(s.current is not None for s in self.streams.values()):
            for s in self.streams.values():
                self._check_done(s, source)
            return
        for name, s in self.streams.items():
            self._check_done(s, source)
            if s.preempted and not self._restore(s):
                continue
            if s.current is None and s.queue:
                self._start(s)
                if mode == "seq":
                    self._top_up(s)
                    break  # one request on the device at a time
            self._top_up(s)

    def _start(self, s: _Stream) -> None:
        req = s.queue.popleft()
        req.start_s = time.perf_counter()
        s.worker.begin_request(req.x)
        s.current = req
        s.host_queue = deque(range(len(s.served.model)))

    def _top_up(self, s: _Stream) -> None:
        while s.host_queue and s.worker.push(s.host_queue[0]):
            s.host_queue.popleft()

    def _check_done(self, s: _Stream, source: ArrivalSource) -> None:
        req = s.current
        if req is None or s.preempted or s.host_queue or not s.worker.drained():
            return
        if s.worker.last_done != len(s.served.model) - 1:
            return
        req.finish_s = time.perf_counter()
        req.output = s.worker.ws.output().clone()
        s.current = None
        self.completed.append(req)
        source.on_complete(req, req.finish_s)

    # -- real-time mode -------------------------------------------------------------------------

    def _realtime_mode(self, source: ArrivalSource) -> None:
        mode = self.config.mode
        if mode == "seq":  # passive: the BE request in progress runs to its end
            while any(s.current is not None and not s.preempted for s in self.streams.values()):
                for s in self.streams.values():
                    self._check_done(s, source)
                self._progress.acquire(timeout=0.001)
        elif mode == "reef":
            self.preempt_all(self.rt_queue[0], keep=self._padded_streams() if self.config.pad else [])
            if self.config.pad:  # after: an evicted op still running finishes on the core it has
                self._partition_cores(True)
        while self.rt_queue:
            self._run_rt(self.rt_queue.popleft(), source)
            for r in source.due(time.perf_counter()):
                self.submit(r)
        if mode == "reef" and self.config.pad:
            self._partition_cores(False)

    def _partition_cores(self, split: bool) -> None:
        """§5 on a CPU, as a green context partitions SMs: in real-time mode the scheduler (the RT op)
        runs on the first `rt_threads` cores and every BE worker on the others, so padded BE ops
        never take the RT op's core; in normal mode all run anywhere."""
        rt_cores, be_cores = self._cores[:self.config.rt_threads], self._cores[self.config.rt_threads:]
        if not be_cores:
            return  # no core left for padding: every BE stream is preempted instead
        os.sched_setaffinity(0, set(rt_cores) if split else set(self._cores))
        for s in self.streams.values():
            s.worker.pin(set(be_cores) if split else set(self._cores))

    def _padded_streams(self) -> list[_Stream]:
        """§5 rule 2 on a CPU: the BE streams that keep the cores the RT op leaves (`cores -
        rt_threads`), those with an op running first, so keeping them costs no wait."""
        free = self.config.cores - self.config.rt_threads
        active = [s for s in self.streams.values() if s.current is not None and not s.preempted]
        active.sort(key=lambda s: s.worker.running < 0)
        return active[:free]

    def preempt_all(self, trigger: Request, keep: list[_Stream] = ()) -> None:
        """REEF Fig. 8 preempt(): reset host queues, set eviction flags, reset what is running;
        the streams in `keep` (padding, §5) go on."""
        t0 = time.perf_counter()
        active = [s for s in self.streams.values()
                  if s.current is not None and not s.preempted and all(s is not k for k in keep)]
        if not active:
            return
        running = {}
        for s in active:
            s.host_queue.clear()  # (1) reset the host queue; restore rebuilds it
            running[id(s)] = s.worker.set_flag()  # (2) lazy eviction of the in-flight queue
            s.preempted = True
            s.killed_op = -1
            s.current.preemptions += 1
        path = "idle"
        for s in active:
            op = running[id(s)]
            if op < 0:
                continue
            # auto: an op profiled to end within evict_wait_ms is waited for; one that should run
            # longer, or overruns the wait (its process was descheduled), is killed.
            remaining_s = float(s.served.op_s[op]) - s.worker.running_for_s()
            wait_s = {"kill": 0.0, "evict": float("inf"), "auto": self.config.evict_wait_ms / 1e3}[self.config.preempt_path]
            if remaining_s <= wait_s and s.worker.wait_stopped(op, wait_s):
                path = "evict" if path != "kill" else path
                continue
            s.worker.kill()  # (3) abort the running op; it is re-executed from its group's entry
            s.killed_op = op
            path = "kill"
        t1 = time.perf_counter()
        self.preemptions.append(Preemption(path, t1 - trigger.arrival_s, t1 - t0, len(active)))

    def _restore(self, s: _Stream) -> bool:
        """REEF Fig. 8 restore(): re-launch from the entry of the interrupted op's idempotent group."""
        n = len(s.served.model)
        if s.worker.pid is None:
            if not s.worker.restart():
                return False  # its spare is still being forked (by the fork server, not here)
            entry = s.served.imap.entry(s.killed_op)
            s.current.reexecuted_ops += s.killed_op - entry + 1
            s.current.reexecuted_s += float(s.served.op_s[entry:s.killed_op + 1].sum())
            start = entry
        else:
            if not s.worker.drained():
                return False  # evicted ops still draining; they only drop themselves
            start = s.worker.last_done + 1
            s.worker.clear_flag()
        s.preempted = False
        s.killed_op = -1
        s.host_queue = deque(range(start, n))
        return True

    def _run_rt(self, req: Request, source: ArrivalSource) -> None:
        served = self._served(req.model)
        ws = self.rt_ws.get(req.model)
        if ws is None:
            ws = self.rt_ws[req.model] = served.model.workspace()
        req.start_s = time.perf_counter()
        ws.set_input(req.x)
        for i in range(len(served.model)):
            if self.config.mode == "concurrent":
                self.service_be(source)
            elif self.config.pad:
                self._pad(source)
            ws.run_op(i)
        req.finish_s = time.perf_counter()
        req.output = ws.output().clone()
        self.completed.append(req)
        source.on_complete(req, req.finish_s)

    def _pad(self, source: ArrivalSource) -> None:
        """§5 on a CPU: keep BE streams running on the cores the RT op leaves, between RT ops.

        Rule 2 (occupancy): at most `cores - rt_threads` BE streams run in real-time mode, one
        intra-op thread each, so each has a core the RT op does not use. Rule 1 (a BE kernel ends
        before the RT kernel it pads) exists on a GPU because the next RT kernel may need the CUs
        the BE kernel holds; an RT op here never uses more than `rt_threads` cores, so a BE op of
        any length leaves the next RT op its cores, and the unit is the stream's in-flight queue.
        """
        free = self.config.cores - self.config.rt_threads
        streams = list(self.streams.values())
        if free <= 0 or not streams:
            return
        for s in streams:
            if not s.preempted:
                self._check_done(s, source)
        for r in source.due(time.perf_counter()):  # a closed-loop BE client's next request, RT arrivals
            self.submit(r)
        running = [s for s in streams if s.current is not None and not s.preempted]
        for k in range(len(streams)):
            if len(running) >= free:
                break
            s = streams[(self._pad_next + k) % len(streams)]
            if any(s is r for r in running):
                continue
            if s.current is not None:
                # A preempted stream pads too: restoring it is a flag reset or a spare's activation.
                if not self._restore(s):
                    continue
            elif s.queue:
                self._start(s)
            else:
                continue
            s.worker.pin(set(self._cores[self.config.rt_threads:]))  # a restored stream's worker is new
            running.append(s)
            self._pad_next = (self._pad_next + k + 1) % len(streams)
        for s in running:
            before = len(s.host_queue)
            self._top_up(s)
            self.padded_ops += before - len(s.host_queue)
