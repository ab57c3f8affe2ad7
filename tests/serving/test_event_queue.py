"""EventQueue: items in order, a waiting reader woken by a put, a cancelled reader leaving it
usable, and one reader at a time."""

from __future__ import annotations

import asyncio

import pytest

from backfill.serving.event_queue import EventQueue


def test_items_come_out_in_order_and_a_waiting_reader_wakes():
    async def go() -> list[int]:
        queue: EventQueue[int] = EventQueue()
        queue.put_nowait(1)
        queue.put_nowait(2)
        got = [await queue.get(), await queue.get()]
        assert queue.empty()
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        assert not reader.done()   # nothing to read: it waits
        asyncio.get_running_loop().call_soon(queue.put_nowait, 3)
        got.append(await reader)
        return got
    assert asyncio.run(go()) == [1, 2, 3]


def test_a_cancelled_reader_leaves_the_queue_usable():
    async def go() -> int:
        queue: EventQueue[int] = EventQueue()
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        queue.put_nowait(7)   # no waiter to wake: the item stays
        assert queue.qsize() == 1
        return await queue.get()
    assert asyncio.run(go()) == 7


def test_a_put_to_a_reader_cancelled_in_the_same_turn_is_kept():
    async def go() -> int:
        queue: EventQueue[int] = EventQueue()
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        reader.cancel()          # its future is done (cancelled) before the put below
        queue.put_nowait(5)
        with pytest.raises(asyncio.CancelledError):
            await reader
        return queue.get_nowait()
    assert asyncio.run(go()) == 5


def test_a_second_reader_is_refused():
    async def go() -> None:
        queue: EventQueue[int] = EventQueue()
        first = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await queue.get()
        queue.put_nowait(1)
        assert await first == 1
    asyncio.run(go())
