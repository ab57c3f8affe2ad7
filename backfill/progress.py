"""A progress line every few seconds while a long stretch of a command runs (a model load, a kernel
build, a benchmark's mode, a server's start), so that a user never watches more than
PROGRESS_EVERY_S of silence.

    with Heartbeat(print, "fcfs", lambda: f"{stats.finished['online']}/{n} requests done"):
        run_the_mode()

prints `   ... fcfs: 12 s, 3/38 requests done` every PROGRESS_EVERY_S from a daemon thread (the
work itself may hold the main thread, or the GIL only briefly between torch operators).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# At most this long between two lines of a benchmark's output (issue #58: every benchmark speaks
# at least every 10 s); a little less, so that a slow print still lands inside it.
PROGRESS_EVERY_S = 8.0


class Heartbeat:
    def __init__(self, log: Callable[[str], None], what: str, status: Callable[[], str] | None = None,
                 every_s: float = PROGRESS_EVERY_S, expected_s: float | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        self.log, self.what, self.status, self.every_s, self.expected_s = log, what, status, every_s, expected_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0.0
        self.beats = 0

    def line(self) -> str:
        """The progress line as of now."""
        elapsed_s = time.monotonic() - self.started
        of = f" of about {self.expected_s:.0f} s" if self.expected_s else ""
        try:
            status = self.status() if self.status is not None else ""
        except Exception as exc:  # a status that cannot be read must not end the benchmark
            status = f"(status unavailable: {type(exc).__name__})"
        return f"   ... {self.what}: {elapsed_s:.0f} s{of}" + (f", {status}" if status else "")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beats += 1
            self.log(self.line())

    def __enter__(self) -> Heartbeat:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {self.what}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more lines (idempotent; leaving the `with` block calls it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.every_s)

    def __exit__(self, *exc) -> None:
        self.stop()
