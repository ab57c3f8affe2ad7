import time

import pytest

from backfill.progress import Heartbeat


def test_a_heartbeat_speaks_while_its_stretch_runs_and_stops_after():
    lines: list[str] = []
    done = [0]
    with Heartbeat(lines.append, "fcfs", lambda: f"{done[0]}/3 requests done", every_s=0.05, expected_s=60):
        for k in range(3):
            time.sleep(0.06)
            done[0] = k + 1
    n = len(lines)
    time.sleep(0.15)
    assert n >= 3 and len(lines) == n            # nothing after the block
    assert lines[0].startswith("   ... fcfs: 0 s of about 60 s, ") and lines[0].endswith("requests done")


def test_a_failing_status_is_reported_not_raised_and_bad_periods_are_refused():
    hb = Heartbeat(lambda line: None, "x", lambda: 1 / 0)
    hb.started = time.monotonic()
    assert "status unavailable: ZeroDivisionError" in hb.line()
    with pytest.raises(ValueError):
        Heartbeat(print, "x", every_s=0)
