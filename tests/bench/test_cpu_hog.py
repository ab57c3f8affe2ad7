"""The noisy neighbour of `bench coserve --slowdown-at-s`: a busy loop on one core, started late, always stopped."""

import os
import time

from backfill.bench.cpu_hog import CpuHog, hog_after, hog_core


def wait_for(predicate, timeout_s=20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_the_hog_busies_one_core_until_stopped():
    hog = CpuHog()
    assert hog.core == hog_core() and not hog.running
    hog.start()
    try:
        assert hog.running
        pid = hog.pid
        assert wait_for(lambda: os.sched_getaffinity(pid) == {hog.core})  # it pins itself once started
    finally:
        hog.stop()
    assert not hog.running


def test_the_hog_starts_after_its_delay_and_stops_with_the_run():
    said = []
    with hog_after(None) as none:
        assert none is None
    with hog_after(0.2, log=said.append) as hog:
        assert not hog.running                 # not yet: the run's first part is on a quiet machine
        assert wait_for(lambda: hog.running)
    assert not hog.running and said and "core" in said[0]
    with hog_after(30.0, log=said.append) as late:
        pass                                   # a run shorter than the delay never starts it
    assert not late.running and len(said) == 1
