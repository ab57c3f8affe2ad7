"""The portable "device" for best-effort work: a worker process per BE stream (REEF §4, portable form).

The scheduler launches ops into the worker's in-flight queue, a ring in shared memory whose capacity
bounds how much launched work a preemption must discard (REEF §4.2 caps its device queue at 4). The
worker pops an op, checks the preemption flag, and runs the op or, if the flag is set, drops it
(lazy eviction, recording where it stopped). What is running can be aborted outright by killing the
process (REEF §4.3, the OS kills what the device cannot). All tensors live in shared memory, so a
spare worker, forked ahead of need by a fork server (never by the scheduler), replaces a killed one
and re-executes from the entry of the killed op's idempotent group.

Workers run ops on one intra-op thread: forked children cannot use an OpenMP pool their parent
started, and on a 2-core machine shared with other jobs one thread per process is also the fastest.
"""

from __future__ import annotations

import ctypes
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
_PR_SET_PDEATHSIG = 1
_MP = multiprocessing.get_context("fork")


def _serve(model: OpModel, ctl: np.ndarray, ws: Workspace, capacity: int, items, progress, lock) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    low_water = capacity // 2 if capacity <= 64 else 0
    while True:
        items.acquire()
        idx = int(ctl[RING + ctl[POPPED] % capacity])
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


# Semaphore sets the worker generations of a stream use in turn. At most two are live (the
# running worker and its spare); a set comes round again only long after its worker was killed.
_SLOTS = 4
# Fork-server request slots (int64): the semaphore set the next spare uses, the spare's pid back,
# and how long the fork took (ns): what each kill costs in CPU time, off the scheduler's path.
_REQ_SLOT, _REPLY_PID, _FORK_NS = range(3)


def _die_with_parent() -> None:
    """A worker or spare is killed when its fork server ends, so none outlives the scheduler."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: close() still kills the worker and its spare


def _fork_server(worker: "BEWorker") -> None:
    """Fork spare workers on request, so the scheduler's process never forks after start-up.

    Its children are reaped by the kernel (SIGCHLD ignored): the scheduler kills them by pid and
    never waits for them, as REEF reclaims a reset stream's memory in the background (§4.2).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    if worker.nice_offset:
        os.nice(worker.nice_offset)  # forks run at BE priority; workers inherit the level
    while True:
        worker._fork_req.acquire()
        slot = int(worker._srv[_REQ_SLOT])
        if slot < 0:
            os._exit(0)
        items, lock, activate = worker._slots[slot]
        start_ns = time.monotonic_ns()
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent()
                activate.acquire()  # a spare sleeps until it replaces a killed worker
                _serve(worker.model, worker.ctl, worker.ws, worker.capacity, items, worker.progress, lock)
            finally:
                os._exit(1)
        worker._srv[_REPLY_PID] = pid
        worker._srv[_FORK_NS] = time.monotonic_ns() - start_ns
        worker._fork_done.release()


class BEWorker:
    """One BE stream's worker process, its shared workspace and its in-flight queue.

    Restore after a kill activates a spare process that a fork server (a process forked once, at
    start-up) forked ahead of need, so neither a preemption nor a restore forks in the scheduler.
    """

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
        self._srv_shm = SharedMemory(create=True, size=8 * 3)
        self.ctl = np.ndarray((RING + capacity,), dtype=np.int64, buffer=self._ctl_shm.buf)
        self._srv = np.ndarray((3,), dtype=np.int64, buffer=self._srv_shm.buf)
        self.ws = model.workspace(self._ws_shm.buf)
        self._slots = [(_MP.Semaphore(0), _MP.Lock(), _MP.Semaphore(0)) for _ in range(_SLOTS)]
        self._fork_req, self._fork_done = _MP.Semaphore(0), _MP.Semaphore(0)
        self._next_slot = 0
        self._pending_slot: int | None = None
        self._spare: tuple | None = None
        self.pid: int | None = None
        self.restarts = 0
        self.fork_s: list[float] = []  # each spare's fork, timed by the fork server
        self._server_pid = os.fork()
        if self._server_pid == 0:
            try:
                _fork_server(self)
            finally:
                os._exit(1)
        self._reset_ctl()
        self.ensure_spare()
        if not self._activate_spare(timeout_s=30.0):
            self.close()
            raise RealtimeError("the fork server started no BE worker within 30 s")
        self.ensure_spare()

    def _reset_ctl(self) -> None:
        self.ctl[:] = 0
        self.ctl[RUNNING] = self.ctl[STOPPED_AT] = self.ctl[LAST_DONE] = -1

    def ensure_spare(self) -> None:
        """Ask the fork server for the next restore's process (non-blocking; idempotent)."""
        if self._spare is not None or self._pending_slot is not None:
            return
        slot = self._next_slot
        self._next_slot = (slot + 1) % _SLOTS
        items, lock, activate = self._slots[slot]
        # The set's last user was killed long ago; it may have left counts or the lock held.
        while items.acquire(False):
            pass
        while activate.acquire(False):
            pass
        if lock.acquire(False):
            lock.release()
        else:
            lock.release()
        self._srv[_REQ_SLOT] = slot
        self._pending_slot = slot
        self._fork_req.release()

    def spare_ready(self, timeout_s: float = 0.0) -> bool:
        if self._spare is None and self._pending_slot is not None:
            if self._fork_done.acquire(timeout=timeout_s) if timeout_s > 0 else self._fork_done.acquire(False):
                self._spare = (int(self._srv[_REPLY_PID]), *self._slots[self._pending_slot])
                self.fork_s.append(int(self._srv[_FORK_NS]) / 1e9)
                self._pending_slot = None
        return self._spare is not None

    def _activate_spare(self, timeout_s: float = 0.0) -> bool:
        if not self.spare_ready(timeout_s):
            return False
        self.pid, self.items, self.lock, activate = self._spare
        self._spare = None
        activate.release()
        return True

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

        Once SIGKILL is sent the process runs no more user code; the kernel reaps it (its parent,
        the fork server, ignores SIGCHLD), off the preemption path, as REEF's background
        reclamation of a reset stream (§4.2).
        """
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.pid = None

    def pin(self, cores: set[int]) -> None:
        """Run the worker on these cores only (§5 on a CPU: the cores the RT op leaves)."""
        if self.pid is None:
            return
        try:
            os.sched_setaffinity(self.pid, cores)
        except (ProcessLookupError, PermissionError):
            pass  # killed meanwhile; its replacement is pinned when it pads

    def restart(self) -> bool:
        """Replace a killed worker by its spare over the same shared workspace (what the killed op
        wrote is re-executed by the caller); False, changing nothing, while the spare is still
        being forked. The next spare is requested at once, so it forks while BE work runs."""
        if self.pid is not None:
            raise RealtimeError("restart of a live worker")
        if not self.spare_ready():
            return False
        last_done = self.last_done
        self._reset_ctl()
        self.ctl[LAST_DONE] = last_done
        self._activate_spare()
        self.restarts += 1
        self.ensure_spare()
        return True

    def close(self) -> None:
        self.kill()
        if self._pending_slot is not None:
            self.spare_ready(timeout_s=5.0)
        if self._spare is not None:
            self.pid = self._spare[0]
            self._spare = None
            self.kill()
        if self._server_pid:
            self._srv[_REQ_SLOT] = -1
            self._fork_req.release()
            try:
                os.waitpid(self._server_pid, 0)
            except ChildProcessError:
                pass
            self._server_pid = 0
        del self.ws, self.ctl, self._srv
        for shm in (self._ws_shm, self._ctl_shm, self._srv_shm):
            shm.close()
            shm.unlink()

    def __enter__(self) -> "BEWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
