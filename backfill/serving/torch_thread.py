"""One thread for all of a process's torch work: loading, profiling and the scheduler loop.

PyTorch's CPU kernels run on OpenMP (libgomp), which keeps a pool of worker threads for every
thread that has entered a parallel region. Once two such pools exist (say the main thread
loaded the model and a scheduler thread runs it), libgomp manages more threads than there are
CPUs and stops spin-waiting between parallel regions, so each of the hundreds of regions of a
decode step waits on a futex wake-up instead, and a small decode step takes about twice as long.
The serving stack therefore builds, profiles and runs the model here.

glibc's malloc maps every block above its mmap threshold afresh and gives it back on free, and
gives a thread other than the main one an arena of heaps that are unmapped as they empty: a
prompt step's activations (megabytes each) were faulted in page by page on every step on this
thread. Before this thread starts, glibc is told to keep one arena, to serve blocks of up to
32 MB from it and to keep freed memory for reuse, as the allocators PyTorch's CPU guides preload
(tcmalloc, jemalloc) do.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_thread: threading.Thread | None = None


def _remember_thread() -> None:
    global _thread
    _thread = threading.current_thread()


# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8


def keep_freed_memory_for_reuse() -> bool:
    """Under glibc: one malloc arena for every thread, blocks of up to 32 MB from it, and up to
    256 MB of freed memory kept instead of given back; False where the C library is not glibc.
    Process-wide; arenas already made stay."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20),
                (_M_TOP_PAD, 64 << 20))
    return all([mallopt(param, value) == 1 for param, value in settings])


_malloc_tuned = False


def _tune_malloc_once() -> None:
    """Before the torch thread's first allocation (the first submit starts it)."""
    global _malloc_tuned
    if not _malloc_tuned:
        _malloc_tuned = True
        keep_freed_memory_for_reuse()


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
            _tune_malloc_once()
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

    _tune_malloc_once()
    return _EXECUTOR.submit(loop)


def _start_on_own_thread(fn: Callable[[], None]) -> Future:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backfill-scheduler")
    future = executor.submit(fn)
    executor.shutdown(wait=False)  # the thread ends with fn
    return future
