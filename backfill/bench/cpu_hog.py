"""A machine that slows mid-run: a busy-loop process pinned to one core, started a set time into a
benchmark's phase and stopped at its end, the same schedule in every mode, so that a policy's
latency is compared with the baseline's under the same slowdown (a noisy neighbour). Torch-free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator


def hog_core() -> int:
    """The core the hog takes: the last one this process may run on."""
    return sorted(os.sched_getaffinity(0))[-1]


class CpuHog:
    """One busy-loop process on one core, from start() to stop(); its start time is kept."""

    def __init__(self, core: int | None = None) -> None:
        self.core = hog_core() if core is None else core
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self._proc is not None:
            return
        code = f"import os\nos.sched_setaffinity(0, {{{self.core}}})\nwhile True:\n    pass\n"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def hog_after(delay_s: float | None, log=print) -> Iterator[CpuHog | None]:
    """Start a CpuHog delay_s after entering (None: never), stop it on leaving."""
    if delay_s is None:
        yield None
        return
    hog = CpuHog()
    lock = threading.Lock()
    stopped = False

    def begin() -> None:
        with lock:
            if not stopped:
                hog.start()
                log(f"   (a CPU hog now busy on core {hog.core}: the machine slows)")

    timer = threading.Timer(delay_s, begin)
    timer.daemon = True
    timer.start()
    try:
        yield hog
    finally:
        with lock:
            stopped = True
        timer.cancel()
        hog.stop()
