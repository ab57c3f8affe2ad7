"""AsyncEngine: the scheduler loop on the torch thread, with an asyncio streaming API.

The server and the benchmark harness both use this; nothing else drives the scheduler.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, AsyncIterator, Callable, NamedTuple, TypeVar

from backfill.errors import EngineStoppedError
from backfill.types import FinishReason, GenerationRequest, RequestClass, TokenEvent
from backfill.serving.event_queue import EventQueue
from backfill.serving.scheduler import PreemptionObserver, Scheduler
from backfill.serving.sequence import SeqStatus
from backfill.serving.stats import SchedulerStats
from backfill.serving.torch_thread import run_on_torch_thread, start_on_torch_thread

if TYPE_CHECKING:
    from backfill.engine.config import ModelConfig
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.lora import AdapterRegistry
    from backfill.engine.model import LlamaModel
    from backfill.policy.interface import SchedulerState, SchedulingPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")


# An idle engine's first step waits for requests arriving together until none has come for this long.
ARRIVAL_QUIET_S = 0.001

# Best-effort work run on the loop's thread between two steps and while idle (e.g. finetuning
# units, backfill/finetune/colocate.py; a node's pool share, backfill/node/model_server.py);
# returns whether it did anything.
BetweenStepsTask = Callable[[], bool]


class SequenceView(NamedTuple):
    """One request in the engine, as readers outside the scheduler see it."""

    request_id: str
    request_class: RequestClass
    status: SeqStatus


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, tokenizer=None, model_name: str = "backfill",
                 arrival_gather_s: float = 0.0) -> None:
        self.scheduler = scheduler
        # Requests sent at once reach the engine one by one (over HTTP, each parsed in turn); an idle
        # engine that stepped on the first would prefill it alone and the rest a step later, and
        # every earlier request would then decode beside one more prompt-carrying step.
        self.arrival_gather_s = arrival_gather_s
        self._last_arrival_s = 0.0
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._queues: dict[str, EventQueue[TokenEvent]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_future: Future | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._between_steps_tasks: list[BetweenStepsTask] = []
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()

    @property
    def policy(self) -> SchedulingPolicy:
        """The scheduling policy the engine's scheduler follows."""
        return self.scheduler.policy

    @property
    def model_config(self) -> ModelConfig:
        """The served model's shape (vocabulary, layers)."""
        return self.scheduler.runner.config

    @property
    def model(self) -> LlamaModel:
        """The served model (a finetuning job trains adapters on its frozen weights)."""
        return self.scheduler.runner.model

    @property
    def adapters(self) -> AdapterRegistry:
        """The LoRA adapters requests may name (GenerationRequest.adapter)."""
        return self.scheduler.runner.adapters

    # --- read-only views of the engine's state (any thread; values may be a step old) ---------

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may ask for, tokens."""
        return self.scheduler.max_model_len

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's live counters (steps, tokens per class, preemptions): read them, never write."""
        return self.scheduler.stats

    @property
    def kv_usage(self) -> float:
        """Fraction of the usable KV blocks in use."""
        return self.scheduler.kv.usage

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block."""
        return self.scheduler.kv.block_size

    @property
    def kv_pool(self) -> KVBlockPool:
        """The KV block pool, for between-steps tasks that lease idle blocks on the engine's thread."""
        return self.scheduler.kv

    def cached_prompt_tokens(self, request: GenerationRequest) -> int:
        """The leading prompt tokens of a request not yet submitted that the prefix cache holds now,
        for admission's prediction; a probe that takes nothing (UnknownAdapterError: no such adapter)."""
        return self.scheduler.cached_prompt_tokens(request)

    def sequences(self) -> list[SequenceView]:
        """The requests in the engine now (id, class, status)."""
        # list() copies the dict in one C call under the GIL, so the loop cannot resize it mid-iteration.
        return [SequenceView(seq_id, seq.request_class, seq.status)
                for seq_id, seq in list(self.scheduler.seqs.items())]

    def has_work(self) -> bool:
        """Whether the engine has requests queued, running or to cancel."""
        return self.scheduler.has_work()

    def snapshot(self) -> SchedulerState:
        """What the policy would see now; call on the engine's thread (a between-steps task)."""
        return self.scheduler.snapshot()

    def invalidate_blocks(self, block_ids: list[int]) -> None:
        """These KV blocks were reclaimed (Valve §4.3): their requests recompute what they lose."""
        self.scheduler.invalidate_blocks(block_ids)

    # --- typed hooks ----------------------------------------------------------------------------

    def add_between_steps_task(self, task: BetweenStepsTask) -> Callable[[], None]:
        """Run task on the loop's thread after each step and while idle, after those added before it;
        an idle loop wakes at once to run it. Returns the function that removes it."""
        self._between_steps_tasks.append(task)
        self._wake.set()
        return lambda: self.remove_between_steps_task(task)

    def remove_between_steps_task(self, task: BetweenStepsTask) -> None:
        """Take task off the list (idempotent; a task may remove itself as it runs)."""
        if task in self._between_steps_tasks:
            self._between_steps_tasks.remove(task)

    @property
    def between_steps_tasks(self) -> tuple[BetweenStepsTask, ...]:
        return tuple(self._between_steps_tasks)

    def add_preemption_observer(self, observer: PreemptionObserver) -> Callable[[], None]:
        """Tell observer (request id, kind, time) of each request a preemption touches, on the loop's
        thread; returns the function that removes it."""
        return self.scheduler.add_preemption_observer(observer)

    def _run_between_steps_tasks(self) -> bool:
        did_work = False
        for task in tuple(self._between_steps_tasks):  # a task may remove itself
            did_work |= bool(task())
        return did_work

    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """Run fn on the scheduler's thread between two steps and return its result: torch work
        from elsewhere (loading an adapter, building a finetuning job) keeps to the one torch thread."""
        if not self.running:
            return await asyncio.to_thread(run_on_torch_thread, fn)
        future: Future = Future()
        self._calls.append((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller gets it; the loop goes on
                    future.set_exception(exc)

    @property
    def running(self) -> bool:
        return self._loop_future is not None and not self._loop_future.done()

    @property
    def warming_up(self) -> bool:
        """The runner still compiles in the background (engine/compiled_decode.py's buckets)."""
        return self.scheduler.runner.warming_up

    def wait_until_warm(self, timeout_s: float | None = None) -> None:
        """Block until the runner's background compilation is done (as the server's /health waits)."""
        self.scheduler.runner.wait_until_warm(timeout_s)

    def discard_unfinished(self) -> None:
        """On a stopped engine: cancel every request left and step until none is, so the next start
        begins empty (a benchmark's next round cuts its offline requests this way)."""
        if self.running:
            raise RuntimeError("discard_unfinished needs a stopped engine")
        run_on_torch_thread(self._discard_unfinished)

    def _discard_unfinished(self) -> None:
        for seq_id in list(self.scheduler.seqs):
            self.scheduler.cancel(seq_id)
        while self.scheduler.has_work():
            self.scheduler.step()

    async def start(self) -> None:
        if self.running:
            return
        self._loop = asyncio.get_running_loop()
        # The scheduler thread and the event loop share the GIL; a short switch interval lets an
        # arriving online request reach the safepoint flag within a layer, not a default 5 ms later.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        # A full collection holds the GIL while it scans every tracked object, stalling the step
        # loop and the arrival path alike (preemption outliers). What exists now lives as
        # long as the engine; freezing it leaves full collections only the objects made since.
        gc.collect()
        gc.freeze()
        self._stopping.clear()
        # On the thread that built the model: one OpenMP pool (see torch_thread).
        self._loop_future = start_on_torch_thread(self._run)

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._loop_future is not None:
            await asyncio.wrap_future(self._loop_future)
            self._loop_future = None
        while self._calls:  # queued as the loop ended
            _, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStoppedError("the engine stopped before running this"))
        gc.unfreeze()  # cycles among what was frozen at start can be collected again

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queue request and return its event stream. Raises a typed error at once on bad input."""
        queue: EventQueue[TokenEvent] = EventQueue()
        self.open(request, queue)
        return self._stream(request.request_id, queue)

    def open(self, request: GenerationRequest, queue: EventQueue[TokenEvent]) -> None:
        """Queue request with its events put on queue (several requests may share one; an event
        names its request); close(request_id, finished) once done. Raises a typed error at once
        on bad input. The server reads its streams' queues directly: every async layer between
        the engine and the socket costs the event loop CPU per token, beside the engine's step."""
        if not self.running:
            raise EngineStoppedError("engine is not running")
        self._queues[request.request_id] = queue
        try:
            self.scheduler.add(request)
        except Exception:
            self._queues.pop(request.request_id, None)
            raise
        self._last_arrival_s = time.monotonic()
        self._wake.set()

    def close(self, request_id: str, finished: bool) -> None:
        """Stop delivering request_id's events; unless it finished, cancel it (frees its blocks)."""
        self._queues.pop(request_id, None)
        if not finished:
            self.cancel(request_id)

    async def _stream(self, request_id: str, queue: EventQueue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            self.close(request_id, finished)   # not finished: the consumer went away

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)
        self._wake.set()

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
                if event.finished:  # the stream holds its own reference; drop ours even if never read
                    self._queues.pop(event.request_id, None)

    def _gather_arrivals(self) -> None:
        """Wait, from idle, until no request has arrived for ARRIVAL_QUIET_S or arrival_gather_s has passed."""
        deadline = time.monotonic() + self.arrival_gather_s
        while not self._stopping.is_set():
            now = time.monotonic()
            until = min(self._last_arrival_s + ARRIVAL_QUIET_S, deadline)
            if now >= until:
                return
            time.sleep(until - now)

    def _run(self) -> None:
        scheduler = self.scheduler
        idle = True
        while not self._stopping.is_set():
            self._run_calls()
            if not scheduler.has_work():
                if not self._run_between_steps_tasks():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                idle = True
                continue
            if idle and self.arrival_gather_s > 0:
                self._gather_arrivals()
            idle = False
            try:
                events = scheduler.step()
            except Exception:  # a bug must not strand every waiting client
                log.exception("scheduler step failed; failing the requests in flight")
                events = [TokenEvent(seq_id, (), "", finished=True, finish_reason=FinishReason.ERROR)
                          for seq_id in list(scheduler.seqs)]
                for seq_id in list(scheduler.seqs):
                    scheduler.cancel(seq_id)
                scheduler.step()
            if events and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver, events)
            self._run_between_steps_tasks()
        self._run_calls()
        # Stopping: tell every open stream it ended.
        leftovers = [TokenEvent(seq_id, (), "", finished=True, finish_reason=FinishReason.CANCELLED)
                     for seq_id in list(self._queues)]
        if leftovers and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, leftovers)

    async def generate(self, request: GenerationRequest) -> tuple[list[int], str, FinishReason | None]:
        """Run one request to completion: (output token ids, text, finish reason)."""
        ids: list[int] = []
        parts: list[str] = []
        reason = None
        async for event in self.submit(request):
            ids.extend(event.token_ids)
            parts.append(event.text)
            reason = event.finish_reason
        return ids, "".join(parts), reason
