"""REEF §4.2's in-flight window and §4.4's restore point, on a fake device with a fake clock."""

from __future__ import annotations

import pytest

from backfill.errors import RealtimeError
from backfill.realtime.idempotence import IdempotenceMap
from backfill.realtime.launch_window import LaunchWindow


class FakeStream:
    """A stream of a fake device: ops run in launch order, each op_ms long, on a clock we move."""

    def __init__(self, op_ms: float) -> None:
        self.now_ms = 0.0
        self.op_ms = op_ms
        self.busy_until_ms = 0.0
        self.launched: list[int] = []

    def launch(self, op: int):
        self.launched.append(op)
        self.busy_until_ms = max(self.busy_until_ms, self.now_ms) + self.op_ms
        end = self.busy_until_ms
        stream = self

        class Event:
            def query(self) -> bool:
                return stream.now_ms >= end

        return Event()


# Ops 0-9; op 5 updates op 3's output in place, so its group starts at 3 (REEF §4.4).
IMAP = IdempotenceMap("m", tuple(f"op{i}" for i in range(10)), tuple(i != 5 for i in range(10)),
                      tuple(3 if i == 5 else i for i in range(10)))


def test_the_window_bounds_what_an_rt_arrival_waits_for():
    stream = FakeStream(op_ms=2.0)
    window = LaunchWindow(4, stream.launch, IMAP)
    window.begin(10)
    assert window.top_up() == 4 and len(window.in_flight) == 4 and list(window.host) == list(range(4, 10))
    stream.now_ms = 3.0                        # op 0 done, op 1 running
    assert window.top_up() == 1 and window.last_done == 0
    arrival_ms = stream.now_ms
    pre = window.preempt()
    assert pre.dropped == tuple(range(5, 10)) and pre.in_flight == (1, 2, 3, 4)
    assert not window.host and window.top_up() == 0  # nothing more launches while preempted
    # The RT arrival waits for the in-flight ops only: at most the window, never the request.
    while not window.drained:
        stream.now_ms += 0.5
    assert stream.now_ms - arrival_ms <= window.capacity * stream.op_ms
    assert stream.launched == [0, 1, 2, 3, 4]


def test_without_a_reset_the_stream_restores_after_the_last_launched_op():
    stream = FakeStream(op_ms=1.0)
    window = LaunchWindow(3, stream.launch, IMAP)
    window.begin(10)
    window.top_up()
    pre = window.preempt()
    assert pre.restore_at == 3 and not pre.reset
    assert not window.restore()                # ops 0-2 still in flight: not yet
    stream.now_ms = 10.0
    assert window.restore() and list(window.host) == list(range(3, 10)) and window.last_done == 2
    while not window.done:
        window.top_up()
        stream.now_ms += 1.0
    assert stream.launched == list(range(10))  # every op once: nothing lost, nothing repeated


def test_a_reset_restores_from_the_idempotent_group_entry():
    stream = FakeStream(op_ms=1.0)
    window = LaunchWindow(2, stream.launch, IMAP)
    window.begin(10)
    for _ in range(5):                         # ops 0-4 complete
        window.top_up()
        stream.now_ms += 1.0
        window.poll()
    assert window.last_done == 4
    window.top_up()                            # ops 5 and 6 in flight
    pre = window.preempt(reset=True)
    assert pre.in_flight == (5, 6) and pre.dropped == (7, 8, 9)
    assert pre.restore_at == 3                 # op 5 was interrupted: re-run from its group's entry
    assert window.restore() and list(window.host) == list(range(3, 10)) and window.last_done == 2


def test_a_preemption_of_an_idle_window_restores_where_it_stood():
    window = LaunchWindow(4, FakeStream(1.0).launch, IMAP)
    window.begin(10, start=6)
    pre = window.preempt()
    assert pre.dropped == (6, 7, 8, 9) and pre.in_flight == () and pre.restore_at == 6


@pytest.mark.parametrize("capacity", [0, -1])
def test_bad_windows_are_refused(capacity):
    with pytest.raises(RealtimeError):
        LaunchWindow(capacity, FakeStream(1.0).launch)


def test_a_reset_without_the_idempotence_map_is_refused():
    stream = FakeStream(1.0)
    window = LaunchWindow(2, stream.launch)
    window.begin(4)
    window.top_up()
    with pytest.raises(RealtimeError):
        window.preempt(reset=True)
