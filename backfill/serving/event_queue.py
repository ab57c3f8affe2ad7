"""EventQueue: token events from the engine's delivering callback to one reader on the event loop.

asyncio.Queue does per item what a token stream never needs (a size bound, task_done
accounting, queues of waiting getters and putters); per token that is event-loop CPU, and the
event loop shares the machine's cores with the engine's step. Here a put appends and wakes the
one reader if it waits; a get pops, or waits on one future.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class EventQueue(Generic[T]):
    """Unbounded, one reader at a time: put_nowait() from the loop's thread, `await get()`."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():   # a cancelled reader leaves a done future behind
                waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("EventQueue has one reader; another is already waiting")
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:   # cancelled while waiting
                    self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> T:
        """The next item; IndexError when there is none."""
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items
