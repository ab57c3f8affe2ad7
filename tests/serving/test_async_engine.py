"""AsyncEngine on a tiny random model: an idle engine gathers requests that arrive together."""

import asyncio
import time

import pytest

from backfill.errors import InvalidRequestError
from backfill.serving import async_engine
from backfill.types import GenerationRequest, SamplingParams
from backfill.serving.build import build_tiny_engine
from backfill.serving.config import ServingConfig


def _request(i: int) -> GenerationRequest:
    return GenerationRequest([3 + i, 4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                             request_id=f"r{i}")


async def _first_token_times(engine, gaps_s: float, n: int = 4) -> tuple[list[float], list[float]]:
    """The time each request was submitted, and the time of its first token."""
    await engine.start()
    try:
        streams, submitted = [], []
        for i in range(n):
            submitted.append(time.monotonic())
            streams.append(engine.submit(_request(i)))
            time.sleep(gaps_s)   # arrivals spaced like parsed HTTP requests, the loop held meanwhile

        async def first(stream) -> float:
            async for event in stream:
                if event.token_ids:
                    t = event.time
                    async for _ in stream:
                        pass
                    return t
            raise AssertionError("no token")
        return submitted, list(await asyncio.gather(*(first(s) for s in streams)))
    finally:
        await engine.stop()


@pytest.mark.parametrize("gather_s", [0.0, 0.5])
def test_an_idle_engine_gathers_requests_arriving_together(monkeypatch, gather_s):
    # Arrivals 50 ms apart, far longer than a tiny model's step (about 1 ms, tens on a loaded
    # machine); gathering waits for a quiet gap of 200 ms, far above them.
    monkeypatch.setattr(async_engine, "ARRIVAL_QUIET_S", 0.2)
    engine = build_tiny_engine(ServingConfig(policy="fcfs"))
    engine.arrival_gather_s = gather_s
    submitted, times = asyncio.run(_first_token_times(engine, gaps_s=0.05))
    if gather_s:
        assert max(times) - min(times) < 0.004   # one first step prefilled all four
        assert min(times) > submitted[-1]
    else:
        # Not gathered: the first arrival was stepped at once, before the last arrived 150 ms later.
        assert times[0] < submitted[-1]


def test_gathering_stops_when_arrivals_stop_or_at_the_deadline(monkeypatch):
    monkeypatch.setattr(async_engine, "ARRIVAL_QUIET_S", 0.02)
    engine = build_tiny_engine(ServingConfig(policy="fcfs"))
    engine.arrival_gather_s = 0.2
    engine._last_arrival_s = time.monotonic()
    start = time.monotonic()
    engine._gather_arrivals()
    waited = time.monotonic() - start
    assert 0.015 <= waited < 0.2   # the quiet gap after the last arrival, not the whole window

    engine._last_arrival_s = time.monotonic() + 10.0   # arrivals that never stop: the deadline ends it
    start = time.monotonic()
    engine._gather_arrivals()
    assert 0.19 <= time.monotonic() - start < 2.0


def test_arrival_gather_ms_is_validated():
    assert ServingConfig().arrival_gather_ms == 5.0
    for bad in (-1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(InvalidRequestError, match="arrival_gather_ms"):
            ServingConfig(arrival_gather_ms=bad)


def test_between_steps_tasks_run_in_order_beside_requests_and_come_off_when_removed():
    engine = build_tiny_engine(ServingConfig(policy="fcfs"))
    calls: list[str] = []
    seen_during_run: list[list] = []

    def first() -> bool:
        calls.append("first")
        seen_during_run.append(engine.sequences())
        return False

    def second() -> bool:
        calls.append("second")
        return False

    async def run() -> None:
        await engine.start()
        try:
            remove_first = engine.add_between_steps_task(first)
            engine.add_between_steps_task(second)
            assert engine.between_steps_tasks == (first, second)
            await engine.generate(_request(0))
            remove_first()
            engine.remove_between_steps_task(second)
            assert engine.between_steps_tasks == ()
            count = len(calls)
            await engine.generate(_request(1))
            assert len(calls) == count   # removed tasks never run again
        finally:
            await engine.stop()

    asyncio.run(run())
    assert calls[:2] == ["first", "second"] and calls.count("first") == calls.count("second")
    assert any(view and view[0].request_id == "r0" for view in seen_during_run)   # ran between that request's steps
    assert engine.max_model_len == 512 and 0.0 <= engine.kv_usage <= 1.0   # the tiny model's context
    assert engine.stats.output_tokens["online"] == 6


def test_an_added_task_wakes_an_idle_engine():
    engine = build_tiny_engine(ServingConfig(policy="fcfs"))

    async def run() -> float:
        await engine.start()
        try:
            await asyncio.sleep(0.1)   # the loop is waiting for work
            ran = asyncio.Event()
            loop = asyncio.get_running_loop()
            added = time.monotonic()
            engine.add_between_steps_task(lambda: loop.call_soon_threadsafe(ran.set) and False)
            await asyncio.wait_for(ran.wait(), 5.0)
            return time.monotonic() - added
        finally:
            await engine.stop()

    assert asyncio.run(run()) < 0.04   # woken at once, not at the idle wait's 50 ms timeout
