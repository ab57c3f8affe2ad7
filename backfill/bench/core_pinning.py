"""Where the burst benchmark's processes run: AQUA's producer computes on its own accelerator,
so here it gets a core of its own, and the consumer and the coordinator the others. Torch-free,
so a process can be pinned without loading an engine.
"""

from __future__ import annotations

import os


def pin_apart(producer_pid: int, coordinator_pid: int) -> bool:
    """AQUA's producer computes on its own accelerator: here, on its own core (the last one), and
    this process and the coordinator on the others, every thread of each (sched_setaffinity on a
    pid moves only its main thread; a thread started before, such as the coordinator's request
    worker, would keep every core and serve the consumer's polls on the producer's). False
    where there is one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return False
    rest = set(cores[:-1])
    _pin_threads(producer_pid, {cores[-1]})
    _pin_threads(coordinator_pid, rest)
    _pin_threads(os.getpid(), rest)
    return True


def _pin_threads(pid: int, cores: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass                     # a thread that has just exited


def thread_cpus(pid: int) -> list[list[int]]:
    """Per thread of pid, the cores it may run on."""
    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            out.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    return out
