"""OS-level suspend of an offline engine process on CPU (the portable fallback for pausing compute).

SIGSTOP stops a process (or its whole process group) at any instruction, so it needs no help
from the engine; SIGCONT resumes it. The measured pause latency is the time from sending
SIGSTOP until the kernel reports every target stopped (state 'T' in /proc/<pid>/stat).

Never leave a process stopped: suspend/resume are idempotent and serialized; every live
suspender is resumed by `resume_all()`, which runs at interpreter exit (atexit) and which the
node runtime also calls from its shutdown `finally`. A runtime killed by SIGKILL cannot run any
of this; its offline engines then stay stopped until someone sends SIGCONT.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
import weakref

from backfill.errors import SuspendError

_live: "weakref.WeakSet[ProcessSuspender]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _proc_state(pid: int) -> str | None:
    """The one-letter state of pid, or None if it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may contain spaces: the state follows the last ')'.
    return data[data.rindex(b")") + 2:data.rindex(b")") + 3].decode()


def _group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    members.append(int(name))
            except (ProcessLookupError, PermissionError):
                continue
    return members


class ProcessSuspender:
    """Stops and continues one process, or the process group it leads."""

    def __init__(self, pid: int, *, process_group: bool = False, settle_timeout_s: float = 2.0) -> None:
        if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
            raise SuspendError(f"refusing to suspend pid {pid!r}")
        if process_group and os.getpgid(pid) == os.getpgid(0):
            raise SuspendError(f"pid {pid} shares our process group; suspending it would stop us too")
        self.pid = pid
        self.process_group = process_group
        self.settle_timeout_s = settle_timeout_s
        self.last_pause_latency_s: float | None = None
        self.last_resume_latency_s: float | None = None
        self._suspended = False
        self._lock = threading.Lock()
        with _live_lock:
            _live.add(self)

    @property
    def suspended(self) -> bool:
        return self._suspended

    def suspend(self) -> float:
        """Stop the target; returns the measured pause latency (0.0 if it was already stopped)."""
        with self._lock:
            if self._suspended:
                return 0.0
            t0 = time.perf_counter()
            try:
                self._signal(signal.SIGSTOP)
            except ProcessLookupError:
                raise SuspendError(f"process {self.pid} does not exist") from None
            self._suspended = True
            try:
                self._wait_state(stopped=True)
            except SuspendError:
                # Do not leave a half-stopped target behind a failed call.
                self._continue_locked()
                raise
            self.last_pause_latency_s = time.perf_counter() - t0
            return self.last_pause_latency_s

    def resume(self) -> float:
        """Continue the target; returns the measured resume latency (0.0 if it was running)."""
        with self._lock:
            if not self._suspended:
                return 0.0
            t0 = time.perf_counter()
            self._continue_locked()
            self.last_resume_latency_s = time.perf_counter() - t0
            return self.last_resume_latency_s

    def close(self) -> None:
        self.resume()
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> "ProcessSuspender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _continue_locked(self) -> None:
        try:
            self._signal(signal.SIGCONT)
        except ProcessLookupError:
            pass  # gone: nothing is left stopped
        self._suspended = False
        try:
            self._wait_state(stopped=False)
        except SuspendError:
            pass  # SIGCONT was delivered; a slow scheduler report is not worth failing shutdown

    def _signal(self, sig: signal.Signals) -> None:
        if self.process_group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def _targets(self) -> list[int]:
        return _group_members(self.pid) if self.process_group else [self.pid]

    def _wait_state(self, *, stopped: bool) -> None:
        deadline = time.perf_counter() + self.settle_timeout_s
        while True:
            states = [_proc_state(p) for p in self._targets()]
            # 'T' stopped, 't' traced-stop; None or 'Z'/'X' means gone, which counts as settled.
            if all(s in (None, "Z", "X") or (s in ("T", "t")) == stopped for s in states):
                return
            if time.perf_counter() > deadline:
                raise SuspendError(f"process {self.pid} did not {'stop' if stopped else 'continue'} "
                                   f"within {self.settle_timeout_s} s (states {states})")
            time.sleep(0.0002)


def resume_all() -> None:
    """Continue every process any live suspender stopped (safe to call any number of times)."""
    with _live_lock:
        suspenders = list(_live)
    for s in suspenders:
        s.resume()


atexit.register(resume_all)
