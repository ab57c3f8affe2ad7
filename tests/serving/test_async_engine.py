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


async def _first_token_times(engine, gaps_s: float, n: int = 4) -> list[float]:
    await engine.start()
    try:
        streams = []
        for i in range(n):
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
        return await asyncio.gather(*(first(s) for s in streams))
    finally:
        await engine.stop()


@pytest.mark.parametrize("gather_s", [0.0, 0.5])
def test_an_idle_engine_gathers_requests_arriving_together(monkeypatch, gather_s):
    monkeypatch.setattr(async_engine, "ARRIVAL_QUIET_S", 0.05)   # far above the arrival gaps below
    engine = build_tiny_engine(ServingConfig(policy="fcfs"))
    engine.arrival_gather_s = gather_s
    times = asyncio.run(_first_token_times(engine, gaps_s=0.005))
    spread_s = max(times) - min(times)
    if gather_s:
        assert spread_s < 0.004   # one first step prefilled all four (a tiny model's step is about 1 ms)
    else:
        assert spread_s > 0.01    # each arrival, 5 ms after the last, was stepped on its own


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
