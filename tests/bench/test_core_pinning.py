"""The burst benchmark's producer on a core of its own, every thread of every process pinned."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_producer_pinned_apart_from_the_consumer_every_thread():
    # In a child interpreter: pinning changes the calling process's threads. Each pinned process
    # has started a second thread before it is pinned (as the coordinator's request worker is).
    code = """
import json, os, subprocess, sys, time
from backfill.bench.core_pinning import pin_apart, thread_cpus
child = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
a, b = (subprocess.Popen([sys.executable, "-c", child]) for _ in range(2))
try:
    while any(len(os.listdir(f"/proc/{p.pid}/task")) < 2 for p in (a, b)):
        time.sleep(0.01)
    print(json.dumps([pin_apart(a.pid, b.pid), thread_cpus(a.pid), thread_cpus(b.pid), thread_cpus(os.getpid())]))
finally:
    a.kill(); b.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pinned, producer, coordinator, consumer = json.loads(out.stdout)
    cores = sorted(os.sched_getaffinity(0))
    assert pinned is True
    assert len(producer) == 2 and len(coordinator) == 2
    assert all(t == [cores[-1]] for t in producer)
    assert all(t == cores[:-1] for t in coordinator + consumer)
