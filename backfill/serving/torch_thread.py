"""One thread for all of a process's torch work: loading, profiling and the scheduler loop.

PyTorch's CPU kernels run on OpenMP (libgomp), which keeps a pool of worker threads for every
thread that has entered a parallel region. Once two such pools exist (say the main thread
loaded the model and a scheduler thread runs it), libgomp manages more threads than there are
CPUs and stops spin-waiting between parallel regions, so each of the hundreds of regions of a
decode step waits on a futex wake-up instead, and a small decode step takes about twice as long.
The serving stack therefore builds, profiles and runs the model here.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_thread: threading.Thread | None = None


def _remember_thread() -> None:
    global _thread
    _thread = threading.current_thread()


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backfill-torch", initializer=_remember_thread)


def on_torch_thread() -> bool:
    return threading.current_thread() is _thread


_loop_lock = threading.Lock()
_loop_running = False


def run_on_torch_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run fn on the torch thread and return its result.

    Inline when already there, or when an engine loop holds the thread (waiting for it to stop
    could wait forever; running here is correct, only slower).
    """
    with _loop_lock:
        inline = on_torch_thread() or _loop_running
        if not inline:
            future = _EXECUTOR.submit(fn, *args, **kwargs)
    if inline:
        return fn(*args, **kwargs)
    return future.result()


def start_on_torch_thread(fn: Callable[[], None]) -> Future:
    """Start a long-running loop (the scheduler's) on the torch thread.

    Only one loop fits there; a second engine in the same process gets a thread of its own
    (correct, only slower) rather than waiting behind the first forever.
    """
    global _loop_running
    with _loop_lock:
        if _loop_running:
            return _start_on_own_thread(fn)
        _loop_running = True

    def loop() -> None:
        global _loop_running
        try:
            fn()
        finally:
            with _loop_lock:
                _loop_running = False

    return _EXECUTOR.submit(loop)


def _start_on_own_thread(fn: Callable[[], None]) -> Future:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backfill-scheduler")
    future = executor.submit(fn)
    executor.shutdown(wait=False)  # the thread ends with fn
    return future
