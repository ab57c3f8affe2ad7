"""A BE stream's launches bounded by an in-flight window (REEF §4.2), device-independent.

The host queue holds the ops of the BE request not launched yet; at most `capacity` launched ops
are in flight, each with a completion event (a CUDA event on a GPU, anything with `query()` in a
test). An RT arrival therefore waits for at most the window: what is queued on the host is dropped
at once (REEF's host-queue reset), what is in flight either completes (a device that cannot recall
a launched kernel: CUDA through its public API) or is reset with the device (`reset=True`), and the
stream restores from the entry of the interrupted op's idempotent group (§4.4,
realtime/idempotence.py). The logic lives here, apart from any device, so the window bound, what a
preemption drops and where it restores are tested on a CPU with fake events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from backfill.errors import RealtimeError
from backfill.realtime.idempotence import IdempotenceMap


class CompletionEvent(Protocol):
    def query(self) -> bool:
        """Whether the launched op has completed."""
        ...


@dataclass(frozen=True)
class WindowPreemption:
    dropped: tuple[int, ...]       # ops taken off the host queue, never launched
    in_flight: tuple[int, ...]     # ops launched and not known complete at the preemption
    reset: bool                    # True: the in-flight ops were reset with the device (lost)
    restore_at: int                # the op the stream restarts from


class LaunchWindow:
    def __init__(self, capacity: int, launch: Callable[[int], CompletionEvent], imap: IdempotenceMap | None = None) -> None:
        if capacity < 1:
            raise RealtimeError(f"in-flight window must be >= 1 op, got {capacity}")
        self.capacity = capacity
        self.launch = launch
        self.imap = imap
        self.host: deque[int] = deque()
        self.in_flight: deque[tuple[int, CompletionEvent]] = deque()
        self.last_done = -1
        self.num_ops = 0
        self.preempted: WindowPreemption | None = None

    def begin(self, num_ops: int, start: int = 0) -> None:
        """A request's ops start..num_ops-1 onto the host queue (nothing may be in flight)."""
        if self.in_flight or self.host:
            raise RealtimeError("begin on a BE stream with work queued or in flight")
        if not 0 <= start <= num_ops:
            raise RealtimeError(f"start op {start} outside 0..{num_ops}")
        self.num_ops = num_ops
        self.last_done = start - 1
        self.host = deque(range(start, num_ops))
        self.preempted = None

    def poll(self) -> int:
        """Retire the in-flight ops that completed, in launch order (a stream runs in order);
        returns how many retired."""
        n = 0
        while self.in_flight and self.in_flight[0][1].query():
            op, _ = self.in_flight.popleft()
            self.last_done = op
            n += 1
        return n

    def top_up(self) -> int:
        """Launch from the host queue until the window is full; returns how many launched."""
        if self.preempted is not None:
            return 0
        self.poll()
        n = 0
        while self.host and len(self.in_flight) < self.capacity:
            op = self.host.popleft()
            self.in_flight.append((op, self.launch(op)))
            n += 1
        return n

    @property
    def done(self) -> bool:
        """Every op of the request completed."""
        self.poll()
        return self.preempted is None and not self.host and not self.in_flight and self.last_done == self.num_ops - 1

    @property
    def drained(self) -> bool:
        self.poll()
        return not self.in_flight

    def preempt(self, reset: bool = False) -> WindowPreemption:
        """Drop the host queue (REEF Fig. 8 preempt(), step 1). reset=False: the in-flight ops
        run to completion (at most `capacity` of them: the RT arrival's wait bound) and the stream
        restores after the last launched op. reset=True: they are lost with the device's reset,
        and the stream restores from the entry of the first lost op's idempotent group (§4.4)."""
        self.poll()
        dropped = tuple(self.host)
        self.host.clear()
        in_flight = tuple(op for op, _ in self.in_flight)
        if reset and in_flight:
            if self.imap is None:
                raise RealtimeError("a reset needs the model's idempotence map to restore")
            restore_at = self.imap.entry(in_flight[0])
            self.in_flight.clear()
        elif in_flight:
            restore_at = in_flight[-1] + 1
        else:
            restore_at = dropped[0] if dropped else self.last_done + 1
        self.preempted = WindowPreemption(dropped, in_flight, reset, restore_at)
        return self.preempted

    def restore(self) -> bool:
        """REEF Fig. 8 restore(): the host queue from the restore point, once what was in flight
        has completed; False (changing nothing) while it has not."""
        if self.preempted is None:
            return True
        if not self.drained:
            return False
        at = self.preempted.restore_at
        self.last_done = min(self.last_done, at - 1) if self.preempted.reset else self.last_done
        self.host = deque(range(at, self.num_ops))
        self.preempted = None
        return True


__all__ = ["CompletionEvent", "LaunchWindow", "WindowPreemption"]
