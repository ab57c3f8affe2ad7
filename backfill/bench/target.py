"""What the benchmark driver drives: anything that streams the tokens of a BenchRequest.

A target is an object with an async generator method

    async def generate(self, request: BenchRequest) -> AsyncIterator[StreamChunk]

yielding one StreamChunk per batch of new tokens as they arrive, timed with time.monotonic()
(the clock of asyncio's default loop and of backfill.types.TokenEvent.time). A chunk with
num_tokens 0 carries only facts (prompt tokens, preemptions). Raising ends the request as failed;
the driver may cancel the generator (offline work cut at the end of a run), and a target should
then abandon the request (close the stream, cancel in the engine).

Optionally a target also offers

    async def sample_stats(self) -> dict[str, float]

returning engine gauges right now (queue lengths, KV-cache use, ...); the driver samples it
periodically and the report plots every key over time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol, runtime_checkable

from backfill.bench.workload import BenchRequest


class StreamChunk(NamedTuple):
    time_s: float                         # time.monotonic() when these tokens arrived
    num_tokens: int                       # new output tokens in this chunk (0: facts only)
    prompt_tokens: int | None = None      # once the target knows it
    num_preemptions: int | None = None    # cumulative count for this request, if the target knows it


@runtime_checkable
class Target(Protocol):
    def generate(self, request: BenchRequest) -> AsyncIterator[StreamChunk]: ...


@runtime_checkable
class StatsSource(Protocol):
    async def sample_stats(self) -> dict[str, float]: ...
