"""The portable "device" for best-effort work: a worker process per BE stream (REEF §4, portable form).

The scheduler launches ops into the worker's in-flight queue, a ring in shared memory whose capacity
bounds how much launched work a preemption must discard (REEF §4.2 caps its device queue at 4). The
worker pops an op, checks the preemption flag, and runs the op or, if the flag is set, drops it
(lazy eviction, recording where it stopped). What is running can be aborted outright by killing the
process (REEF §4.3, the OS kills what the device cannot). All tensors live in shared memory, so a
fresh worker forked in its place re-executes from the entry of the killed op's idempotent group.

Workers run ops on one intra-op thread: forked children cannot use an OpenMP pool their parent
started, and on a 2-core machine shared with other jobs one thread per process is also the fastest.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

from backfill.errors import RealtimeError
from backfill.realtime.models import OpModel, Workspace

# Control block fields (int64 slots in shared memory); the ring follows them.
FLAG, PUSHED, POPPED, RUNNING, STOPPED_AT, LAST_DONE, OP_START_NS, RING = range(8)
_EXIT = -2
_MP = multiprocessing.get_context("fork")


def _serve(model: OpModel, ctl: np.ndarray, ws: Workspace, capacity: int, items, progress, lock) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    low_water = capacity // 2 if capacity <= 64 else 0
    while True:
        items.acquire()
        idx = int(ctl[RING + ctl[POPPED] % capacity])
        if idx == _EXIT:
            os._exit(0)
        # The flag is read and RUNNING set under one lock, so the scheduler, which sets the flag
        # under it, knows every op after that point sees the flag (REEF Fig. 8, lines 1-4).
        with lock:
            evicted = bool(ctl[FLAG])
            if not evicted:
                ctl[RUNNING] = idx
                ctl[OP_START_NS] = time.monotonic_ns()
        if evicted:
            if ctl[STOPPED_AT] < 0:
                ctl[STOPPED_AT] = idx
        else:
            ws.run_op(idx)
            ctl[LAST_DONE] = idx
            ctl[RUNNING] = -1
        ctl[POPPED] += 1
        # Wake the scheduler only when the in-flight queue runs low (or the request ends), not per op.
        if ctl[PUSHED] - ctl[POPPED] <= low_water:
            progress.release()


class BEWorker:
    """One BE stream's worker process, its shared workspace and its in-flight queue."""

    def __init__(self, model: OpModel, capacity: int, progress, nice_offset: int = 0) -> None:
        if capacity < 1:
            raise RealtimeError(f"in-flight queue capacity must be >= 1, got {capacity}")
        self.model = model
        self.capacity = capacity
        self.progress = progress
        self.nice_offset = nice_offset
        _, size = model.layout()
        self._ws_shm = SharedMemory(create=True, size=size)
        self._ctl_shm = SharedMemory(create=True, size=8 * (RING + capacity))
        self.ctl = np.ndarray((RING + capacity,), dtype=np.int64, buffer=self._ctl_shm.buf)
        self.ws = model.workspace(self._ws_shm.buf)
        self.lock = _MP.Lock()
        self.pid: int | None = None
        self._zombies: list[int] = []
        self._spare: tuple | None = None
        self.restarts = 0
        self._start()

    def _fork(self, activate=None) -> tuple[int, object, object]:
        """A worker process with its own queue semaphore and lock; a spare (`activate` given)
        sleeps until it is activated in place of a killed worker."""
        items, lock = _MP.Semaphore(0), _MP.Lock()
        pid = os.fork()
        if pid == 0:
            try:
                if self.nice_offset:
                    os.nice(self.nice_offset)
                if activate is not None:
                    activate.acquire()
                _serve(self.model, self.ctl, self.ws, self.capacity, items, self.progress, lock)
            finally:
                os._exit(1)
        return pid, items, lock

    def _reset_ctl(self) -> None:
        self.ctl[:] = 0
        self.ctl[RUNNING] = self.ctl[STOPPED_AT] = self.ctl[LAST_DONE] = -1

    def _start(self) -> None:
        self._reset_ctl()
        self.pid, self.items, self.lock = self._fork()

    def ensure_spare(self) -> None:
        """Fork the next restart's process ahead of need, when the scheduler has time to spare,
        so that a restore after a kill does not fork on the scheduler's path."""
        if self._spare is None:
            activate = _MP.Semaphore(0)
            self._spare = (*self._fork(activate), activate)

    # -- launching ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return int(self.ctl[PUSHED] - self.ctl[POPPED])

    def push(self, op_index: int) -> bool:
        """Launch one op if the in-flight queue has room."""
        if self.in_flight >= self.capacity:
            return False
        self.ctl[RING + self.ctl[PUSHED] % self.capacity] = op_index
        self.ctl[PUSHED] += 1
        self.items.release()
        return True

    def begin_request(self, x: torch.Tensor) -> None:
        """A new request on an idle worker: its input into the shared workspace."""
        if self.in_flight:
            raise RealtimeError("begin_request on a worker with ops in flight")
        self.ws.set_input(x)
        self.ctl[LAST_DONE] = -1
        self.ctl[STOPPED_AT] = -1

    @property
    def last_done(self) -> int:
        return int(self.ctl[LAST_DONE])

    @property
    def running(self) -> int:
        return int(self.ctl[RUNNING])

    def drained(self) -> bool:
        return self.in_flight == 0

    # -- preemption (REEF §4.2-4.3) -------------------------------------------------------------

    def set_flag(self) -> int:
        """Evict every launched op lazily; returns the op running now (-1: none)."""
        with self.lock:
            self.ctl[FLAG] = 1
            return int(self.ctl[RUNNING])

    def clear_flag(self) -> None:
        with self.lock:
            self.ctl[FLAG] = 0
            self.ctl[STOPPED_AT] = -1

    def running_for_s(self) -> float:
        return (time.monotonic_ns() - int(self.ctl[OP_START_NS])) / 1e9

    def wait_stopped(self, running: int, timeout_s: float) -> bool:
        """Lazy eviction alone: wait (sleeping, so the op has a core to finish on) until the op that
        was running completes; False if it is still running after timeout_s."""
        deadline = time.perf_counter() + timeout_s
        while int(self.ctl[RUNNING]) == running and running >= 0:
            if time.perf_counter() >= deadline:
                return False
            time.sleep(20e-6)
        return True

    def kill(self) -> None:
        """Abort what is running (REEF §4.3's reset of the compute units).

        Once SIGKILL is sent the process runs no more user code; reaping it is left to restart(),
        off the preemption path, as REEF reclaims host-queue memory in the background (§4.2).
        """
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGKILL)
        self._zombies.append(self.pid)
        self.pid = None

    def _reap(self, block: bool) -> None:
        """Collect killed processes; without `block`, only those that have finished exiting (a
        killed process still tears down its address space, which must not hold up the scheduler)."""
        for pid in list(self._zombies):
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                self._zombies.remove(pid)

    def lower_priority(self, lower: bool) -> None:
        """While RT work runs, a padded BE op runs 10 nice levels below the scheduler (§5: BE gets
        only what the RT op leaves); back to its normal level after."""
        if self.pid is None:
            return
        base = os.getpriority(os.PRIO_PROCESS, 0)
        try:
            os.setpriority(os.PRIO_PROCESS, self.pid, min(19, base + (10 if lower else self.nice_offset)))
        except (PermissionError, ProcessLookupError):
            pass

    def restart(self) -> None:
        """A fresh worker over the same shared workspace (what a killed op wrote is re-executed)."""
        if self.pid is not None:
            raise RealtimeError("restart of a live worker")
        last_done = self.last_done
        self._reap(block=False)
        if self._spare is not None:
            self._reset_ctl()
            self.pid, self.items, self.lock, activate = self._spare
            self._spare = None
            activate.release()
        else:
            self._start()
        self.ctl[LAST_DONE] = last_done
        self.restarts += 1

    def close(self) -> None:
        if self.pid is not None:
            if self.ctl[FLAG] == 0 and self.in_flight < self.capacity:
                self.ctl[RING + self.ctl[PUSHED] % self.capacity] = _EXIT
                self.ctl[PUSHED] += 1
                self.items.release()
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:
                    done, _ = os.waitpid(self.pid, os.WNOHANG)
                    if done:
                        self.pid = None
                        break
                    time.sleep(0.001)
            if self.pid is not None:
                self.kill()
        if self._spare is not None:
            os.kill(self._spare[0], signal.SIGKILL)
            self._zombies.append(self._spare[0])
            self._spare = None
        self._reap(block=True)
        del self.ws, self.ctl
        for shm in (self._ws_shm, self._ctl_shm):
            shm.close()
            shm.unlink()

    def __enter__(self) -> "BEWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
