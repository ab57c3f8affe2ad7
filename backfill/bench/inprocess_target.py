"""A benchmark Target over backfill's in-process AsyncEngine (no HTTP in the way)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from backfill.bench.target import StreamChunk
from backfill.bench.workload import BenchRequest
from backfill.sampling_params import SamplingParams
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.async_engine import AsyncEngine


class InProcessTarget:
    def __init__(self, engine: AsyncEngine, *, temperature: float = 0.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self._t0 = time.monotonic()

    async def generate(self, request: BenchRequest) -> AsyncIterator[StreamChunk]:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=self.temperature,
                                ignore_eos=request.ignore_eos)
        gen = GenerationRequest(list(request.prompt_token_ids), params, request.request_class,
                                request_id=request.request_id)
        stream = self.engine.submit(gen)
        yield StreamChunk(time.monotonic(), 0, prompt_tokens=len(request.prompt_token_ids))
        async for event in stream:
            # Timed on arrival at the client, as an HTTP client would see it.
            yield StreamChunk(time.monotonic(), len(event.token_ids))

    async def sample_stats(self) -> dict[str, float]:
        stats = self.engine.stats
        seqs = self.engine.sequences()
        online = sum(1 for s in seqs if s.request_class is RequestClass.ONLINE)
        return {
            "online_requests": float(online),
            "offline_requests": float(len(seqs) - online),
            "kv_usage": self.engine.kv_usage,
            "aborted_steps": float(stats.aborted_steps),
            "checkpointed_tokens": float(stats.checkpointed_tokens),
            "recomputed_tokens": float(stats.recomputed_tokens),
        }
