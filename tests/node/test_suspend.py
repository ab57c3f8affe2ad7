import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from backfill.errors import SuspendError
from backfill.node.suspend import ProcessSuspender, _proc_state, resume_all

# A busy loop that publishes an ever-growing counter in an 8-byte file-backed map; with an
# argument "fork" it starts a second, identical worker in the same process group first.
WORKER = textwrap.dedent("""
    import mmap, os, struct, sys
    path = sys.argv[1]
    if len(sys.argv) > 2 and os.fork() == 0:
        path += ".child"
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 8)
    i = 0
    while True:
        i += 1
        m[:8] = struct.pack("Q", i)
""")


def _counter_file(path):
    with open(path, "wb") as f:
        f.write(b"\0" * 8)


def _read(path):
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 8) as m:
        return struct.unpack("Q", m[:8])[0]


def _wait_progress(path, timeout_s=10.0):
    start, deadline = _read(path), time.monotonic() + timeout_s
    while _read(path) == start:
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} made no progress")
        time.sleep(0.005)


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def _spawn(*extra, new_session=False):
        path = str(tmp_path / f"counter{len(procs)}")
        _counter_file(path)
        _counter_file(path + ".child")
        p = subprocess.Popen([sys.executable, "-c", WORKER, path, *extra], start_new_session=new_session)
        procs.append(p)
        _wait_progress(path)
        if extra:
            _wait_progress(path + ".child")
        return p, path

    yield _spawn
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                (os.killpg if p.pid == os.getpgid(p.pid) else os.kill)(p.pid, sig)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)


def test_suspend_stops_progress_and_resume_continues_it(spawn):
    proc, path = spawn()
    s = ProcessSuspender(proc.pid)
    latency_s = s.suspend()
    assert latency_s > 0 and s.suspended and _proc_state(proc.pid) == "T"
    frozen = _read(path)
    time.sleep(0.2)
    assert _read(path) == frozen
    assert s.suspend() == 0.0                                   # idempotent
    s.resume()
    assert not s.suspended and _proc_state(proc.pid) != "T"
    _wait_progress(path)
    assert s.resume() == 0.0
    s.close()


def test_process_group_suspend_stops_every_member(spawn):
    proc, path = spawn("fork", new_session=True)
    with ProcessSuspender(proc.pid, process_group=True) as s:
        s.suspend()
        frozen = (_read(path), _read(path + ".child"))
        time.sleep(0.2)
        assert (_read(path), _read(path + ".child")) == frozen
    # Leaving the context resumes the whole group.
    _wait_progress(path)
    _wait_progress(path + ".child")


def test_resume_all_continues_every_stopped_process(spawn):
    proc, path = spawn()
    s = ProcessSuspender(proc.pid)
    s.suspend()
    resume_all()
    assert not s.suspended
    _wait_progress(path)


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_runtime_that_exits_or_crashes_leaves_nothing_stopped(spawn, ending):
    proc, path = spawn()
    script = textwrap.dedent(f"""
        from backfill.node.suspend import ProcessSuspender
        s = ProcessSuspender({proc.pid})
        s.suspend()
        if {ending == "raise"!r}:
            raise RuntimeError("runtime crashed")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ("runtime crashed" in result.stderr) == (ending == "raise")
    _wait_progress(path)


def test_a_target_that_died_while_stopped_resumes_quietly(spawn):
    proc, _ = spawn()
    s = ProcessSuspender(proc.pid)
    s.suspend()
    proc.kill()
    proc.wait(timeout=10)
    s.resume()
    assert not s.suspended


def test_errors(spawn):
    with pytest.raises(SuspendError, match="refusing"):
        ProcessSuspender(os.getpid())
    with pytest.raises(SuspendError, match="refusing"):
        ProcessSuspender(1)
    proc, _ = spawn()
    with pytest.raises(SuspendError, match="process group"):
        ProcessSuspender(proc.pid, process_group=True)          # shares our group
    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(SuspendError, match="does not exist"):
        ProcessSuspender(proc.pid).suspend()
