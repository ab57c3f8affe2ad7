import httpx
import pytest

from backfill.bench.server_process import served
from backfill.errors import BackfillError


def test_served_runs_the_server_on_loopback_until_the_block_ends():
    with served(["--tiny", "--log-level", "warning"], health_timeout_s=120.0) as url:
        assert url.startswith("http://127.0.0.1:")
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"]
    with pytest.raises(httpx.HTTPError):   # stopped: nothing listens there any more
        httpx.get(f"{url}/health", timeout=2)


def test_a_server_that_exits_at_start_is_a_typed_error():
    with pytest.raises(BackfillError, match="exited with code 2 before it was healthy"):
        with served(["--tiny", "--max-online-queue", "0"], health_timeout_s=60.0):
            pass


def test_stop_ends_a_process_started_in_its_own_session_and_what_it_started():
    import os
    import subprocess
    import sys
    import time

    from backfill.bench.server_process import stop

    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    time.sleep(1.0)
    stop(proc, drain_timeout_s=10)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:   # the grandchild got the signal too; wait for it to go
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError("a process of the stopped group is still alive")


def test_sigterm_raises_keyboard_interrupt_inside_the_block_only():
    import os
    import signal
    import time

    import pytest

    from backfill.bench.server_process import sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)                         # the handler interrupts this at once
    assert signal.getsignal(signal.SIGTERM) == before
