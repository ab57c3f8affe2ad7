"""attach_finetune: a FinetuneJob's units interleaved with an engine's decode steps (HARLI §6.2).

The engine's loop calls the driver between two steps and while idle, on its torch thread (one
OpenMP pool; see serving/torch_thread.py). At each call the driver shows the co-location policy
a snapshot (decode batch, context, arrivals, the next unit's expected time, whether the job has
memory), and runs the units the plan allows; memory comes from the KV pool's idle blocks (HARLI
§4, finetune/memory.py) and goes back, dropping the step in flight, the moment inference needs it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backfill.errors import FinetuneError, LatencyProfileError
from backfill.finetune.job import FinetuneJob
from backfill.finetune.memory import KVLease, inference_demand_blocks, reserve_blocks
from backfill.paths import cache_root
from backfill.policy.harli import ColocationPolicy, ColoState, HarliLatencyModel, HarliPolicy, PauseOnlyPolicy

if TYPE_CHECKING:
    from backfill.serving.async_engine import AsyncEngine

log = logging.getLogger(__name__)

DEFAULT_TPOT_TARGET_MS = 100.0
DEFAULT_MAX_BATCH = 32


def release_driver(driver: _Driver | _PartitionedDriver) -> None:
    """A finished co-location driver gives its memory lease back, leaves the engine's between-steps
    tasks, and settles its future with the job's error or None."""
    driver.lease.give_back()
    driver.engine.remove_between_steps_task(driver)
    if not driver.future.done():
        if driver.handle.error is not None:
            driver.future.set_exception(driver.handle.error)
        else:
            driver.future.set_result(None)


@dataclass
class ColoStats:
    units: int = 0
    unit_ms: float = 0.0            # time in finetuning units
    units_during_decode: int = 0    # units run while sequences were decoding
    paused_gaps: int = 0            # gaps with decode where the plan ran no unit
    stalled_calls: int = 0          # calls where the job could not get its memory
    abandoned_steps: int = 0        # steps dropped to give memory back
    blocks_given_back: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    splits: dict[str, int] = field(default_factory=dict)  # partitioned: "share_infer/share_ft" -> plans


class FinetuneHandle:
    """A job attached to an engine: cancel(), await wait(), done, error."""

    def __init__(self, job: FinetuneJob, future: Future) -> None:
        self.job = job
        self._future = future
        self.cancelled = False
        self.error: BaseException | None = None
        self.stats = ColoStats()

    @property
    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Stop after the unit in flight (the job keeps its checkpoints; a new job on the same
        out_dir resumes from the newest)."""
        self.cancelled = True

    async def wait(self) -> None:
        await asyncio.wrap_future(self._future)


class _Driver:
    def __init__(self, engine: AsyncEngine, job: FinetuneJob, policy: ColocationPolicy, lease: KVLease,
                 tpot_target_ms: float, handle: FinetuneHandle, future: Future) -> None:
        self.engine, self.job, self.policy, self.lease = engine, job, policy, lease
        self.tpot_target_ms = tpot_target_ms
        self.handle, self.future = handle, future

    def _finish(self) -> None:
        release_driver(self)

    def __call__(self) -> bool:
        handle, job, stats = self.handle, self.job, self.handle.stats
        if handle.cancelled or job.finished:
            self._finish()
            return False
        try:
            return self._run_some(stats)
        except Exception as exc:  # the job fails; the engine keeps serving
            log.exception("finetuning job failed")
            handle.error = exc
            job.abandon_step()
            self._finish()
            return False

    def _run_some(self, stats: ColoStats) -> bool:
        job, lease = self.job, self.lease
        snapshot = self.engine.snapshot()
        demand = inference_demand_blocks(snapshot)
        if lease.must_give_back(demand):
            job.abandon_step()  # its activations go; the step is redone later from its start
            stats.abandoned_steps += 1
            stats.blocks_given_back += lease.give_back()
        ready = lease.try_hold(job.memory_bytes(), demand)
        if not ready:
            stats.stalled_calls += 1
        decoding = [s for s in snapshot.seqs if s.running]
        waiting = len(snapshot.seqs) - len(decoding) + (1 if self.engine.has_work() and not snapshot.seqs else 0)
        seqlen = sum(s.num_tokens for s in decoding) / len(decoding) if decoding else 0.0
        lookahead = self.policy.max_units_per_step
        state = ColoState(time.monotonic(), len(decoding), waiting, seqlen, self.tpot_target_ms, ready,
                          job.next_unit_estimate_ms(), job.next_units(lookahead) if lookahead else ())
        plan = self.policy.plan(state)
        stats.reasons[plan.reason] = stats.reasons.get(plan.reason, 0) + 1
        if decoding and plan.units == 0:
            stats.paused_gaps += 1
        for _ in range(plan.units):
            started = time.perf_counter()
            if not job.run_unit():
                break
            stats.units += 1
            stats.unit_ms += (time.perf_counter() - started) * 1e3
            stats.units_during_decode += bool(decoding)
        if job.finished:
            self._finish()
        return plan.units > 0


def attach_finetune(engine: AsyncEngine, job: FinetuneJob, policy: ColocationPolicy | None = None, *, tpot_target_ms: float | None = None,
                    max_batch: int = DEFAULT_MAX_BATCH, latency: HarliLatencyModel | None = None) -> FinetuneHandle:
    """Run job's units between engine's decode steps under a co-location policy (default: HARLI's
    with the given or saved latency model; pause-only when there is none).

    tpot_target_ms is the decode QoS target (default: the engine's policy SLO when it has one)."""
    _refuse_second_job(engine)
    if tpot_target_ms is None:
        slo = engine.policy.slo
        tpot_target_ms = slo.tpot_ms if slo is not None else DEFAULT_TPOT_TARGET_MS
    if policy is None:
        latency = latency or load_saved_latency(engine.model_name)
        if latency is None:
            log.warning("no HARLI latency profile for %s (run `backfill profile finetune`): finetuning only "
                        "while no decode runs", engine.model_name)
            policy = PauseOnlyPolicy()
        else:
            policy = HarliPolicy(latency)
    kv = engine.kv_pool
    # T of HARLI §4.4: memory is given back between units, so T is one unit (estimated before any ran).
    reserve = reserve_blocks(job.next_unit_estimate_ms(default_ms=tpot_target_ms), tpot_target_ms, max_batch,
                             kv.block_size)
    future: Future = Future()
    handle = FinetuneHandle(job, future)
    driver = _Driver(engine, job, policy, KVLease(kv, min(reserve, kv.num_usable)), tpot_target_ms, handle, future)
    engine.add_between_steps_task(driver)   # an idle loop starts the job now
    return handle


def _refuse_second_job(engine: AsyncEngine) -> None:
    """One finetuning job per engine: two would lease the same idle KV blocks. Other between-steps
    tasks (a node's pool share and token reports) run beside it."""
    if any(isinstance(task, (_Driver, _PartitionedDriver)) for task in engine.between_steps_tasks):
        raise FinetuneError("this engine already runs a finetuning job")


class _PartitionedDriver:
    """HARLI on a partitioned device (§5-§6): decode on the engine's thread in its partition,
    finetuning units on a thread of their own in theirs, at the same time. At each decode step
    boundary (and while idle) the engine's thread plans a split over the partitions' realisable
    shares and applies it; the finetuning thread reads the split before each unit and runs it in
    its partition, or waits while its share is 0 (a unit in flight finishes where it started, as
    a kernel keeps its SMs until it ends)."""

    def __init__(self, engine: AsyncEngine, job: FinetuneJob, policy, partitions, lease: KVLease,
                 tpot_target_ms: float, handle: FinetuneHandle, future: Future) -> None:
        self.engine, self.job, self.policy, self.partitions, self.lease = engine, job, policy, partitions, lease
        self.tpot_target_ms = tpot_target_ms
        self.handle, self.future = handle, future
        self._cond = threading.Condition()
        self._share_ft = 0.0
        self._decoding = False
        self._abandon = False                    # the engine's thread asks for the step in flight to go
        self._stop = False
        self._thread = threading.Thread(target=self._finetune_loop, name="backfill-finetune", daemon=True)
        self._thread.start()

    # --- the engine's thread --------------------------------------------------------------------

    def __call__(self) -> bool:
        handle, job, stats = self.handle, self.job, self.handle.stats
        if handle.cancelled or job.finished or handle.error is not None:
            self._finish()
            return False
        snapshot = self.engine.snapshot()
        demand = inference_demand_blocks(snapshot)
        with self._cond:
            abandoning = self._abandon
        if self.lease.must_give_back(demand) and not abandoning:
            with self._cond:  # the finetuning thread drops its step before its next unit
                self._abandon, self._share_ft = True, 0.0
            stats.abandoned_steps += 1
            abandoning = True
        if abandoning:
            with self._cond:
                still = self._abandon
            if still:
                return False  # not yet dropped: keep its blocks accounted until it is
            stats.blocks_given_back += self.lease.give_back()
        ready = self.lease.try_hold(job.memory_bytes(), demand)
        if not ready:
            stats.stalled_calls += 1
        decoding = [s for s in snapshot.seqs if s.running]
        waiting = len(snapshot.seqs) - len(decoding)
        seqlen = sum(s.num_tokens for s in decoding) / len(decoding) if decoding else 0.0
        state = ColoState(time.monotonic(), len(decoding), waiting, seqlen, self.tpot_target_ms, ready,
                          job.next_unit_estimate_ms())
        plan = self.policy.plan(state)
        split = self.partitions.apply(plan.share_infer, plan.share_ft)
        stats.reasons[plan.reason] = stats.reasons.get(plan.reason, 0) + 1
        key = f"{split.share_infer:.2f}/{split.share_ft:.2f}"
        stats.splits[key] = stats.splits.get(key, 0) + 1
        if decoding and split.share_ft == 0:
            stats.paused_gaps += 1
        self.partitions.enter("decode")  # the next decode step runs in decode's partition
        with self._cond:
            self._share_ft = split.share_ft if ready else 0.0
            self._decoding = bool(decoding or waiting)
            self._cond.notify_all()
        return False  # nothing ran on this thread: an idle engine waits for its next wake-up

    def _finish(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        self.partitions.apply(1.0, 0.0)
        self.partitions.enter("decode")
        release_driver(self)

    # --- the finetuning thread ------------------------------------------------------------------

    def _finetune_loop(self) -> None:
        job, stats = self.job, self.handle.stats
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._abandon and self._share_ft <= 0:
                        self._cond.wait(timeout=0.05)
                    if self._stop:
                        return
                    if self._abandon:
                        job.abandon_step()
                        self._abandon = False
                        continue
                    decoding = self._decoding
                if self.handle.cancelled or job.finished:
                    return
                self.partitions.enter("finetune")
                started = time.perf_counter()
                try:
                    more = job.run_unit()
                finally:
                    self.partitions.leave("finetune")
                if not more:
                    return
                stats.units += 1
                stats.unit_ms += (time.perf_counter() - started) * 1e3
                stats.units_during_decode += decoding
        except Exception as exc:  # the job fails; the engine keeps serving
            log.exception("finetuning job failed")
            self.handle.error = exc
            job.abandon_step()


def attach_finetune_partitioned(engine: AsyncEngine, job: FinetuneJob, policy, partitions, *, tpot_target_ms: float,
                                max_batch: int = DEFAULT_MAX_BATCH) -> FinetuneHandle:
    """Run job beside engine's decode on compute partitions (engine/compute_partition.py) under an
    SM-share policy (policy/harli_sm.py: HarliSmPolicy built with partitions.ft_shares(), or a
    baseline). Cancel with handle.cancel(); the driver then stops its thread at the next call."""
    _refuse_second_job(engine)
    kv = engine.kv_pool
    reserve = reserve_blocks(job.next_unit_estimate_ms(default_ms=tpot_target_ms), tpot_target_ms, max_batch,
                             kv.block_size)
    future: Future = Future()
    handle = FinetuneHandle(job, future)
    driver = _PartitionedDriver(engine, job, policy, partitions, KVLease(kv, min(reserve, kv.num_usable)),
                                tpot_target_ms, handle, future)
    engine.add_between_steps_task(driver)
    return handle


def harli_profile_path(model_name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return cache_root() / "profiles" / f"harli-{safe}.json"


def load_saved_latency(model_name: str) -> HarliLatencyModel | None:
    path = harli_profile_path(model_name)
    if not path.exists():
        return None
    try:
        latency = HarliLatencyModel.load(path)
    except LatencyProfileError as exc:
        log.warning("%s: ignored", exc)
        return None
    if not latency.per_kind:
        log.warning("HARLI profile %s predates stage 2 per unit kind: predicting with its single k1 for "
                    "every kind; re-run `backfill finetune profile` to fit one per kind", path)
    return latency


__all__ = ["FinetuneHandle", "attach_finetune", "attach_finetune_partitioned", "harli_profile_path", "load_saved_latency"]
