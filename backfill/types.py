"""Types of the in-process serving API, shared by the HTTP server and the benchmark harness.

    engine = AsyncEngine.from_config(ServingConfig(...))   # backfill.serving.async_engine
    await engine.start()
    async for event in engine.submit(GenerationRequest(...)):
        ...                                                # TokenEvent per step
    engine.cancel(request_id)
    await engine.stop()
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

from backfill.errors import InvalidRequestError
from backfill.options import knob
from backfill.sampling_params import SamplingParams, TokenConstraint, TokenLogprob

_ids = itertools.count()


class RequestClass(str, enum.Enum):
    ONLINE = "online"     # latency-critical: has TTFT/TPOT SLOs, streams tokens
    OFFLINE = "offline"   # best-effort: throughput only, may be preempted, never lost


@dataclass(frozen=True)
class SLO:
    """Latency objectives of online requests, in milliseconds."""

    ttft_ms: float = knob(1000.0, "online time-to-first-token SLO, ms", group="slo", option="ttft_slo_ms")
    tpot_ms: float = knob(100.0, "online time-per-output-token SLO, ms", group="slo", option="tpot_slo_ms")

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidRequestError(f"SLO {name} must be a positive number, got {value!r}")


class FinishReason(str, enum.Enum):
    STOP = "stop"            # a stop token or stop string
    LENGTH = "length"        # max_tokens or the context limit
    CANCELLED = "cancelled"  # cancel() or client gone
    ERROR = "error"


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_class: RequestClass = RequestClass.ONLINE
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival_time: float = field(default_factory=time.monotonic)
    adapter: str | None = None  # a LoRA adapter loaded on the engine (engine.adapters), None: the base model
    # Structured output: limits each sampled token (a grammar, engine/grammar.py); stateful, one per request.
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt must contain at least one token")
        self.request_class = RequestClass(self.request_class)


@dataclass(frozen=True)
class TokenEvent:
    """What one engine step produced for one request (new tokens and the text they add)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    time: float = field(default_factory=time.monotonic)
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token in token_ids when the request asked for them
    scheduled_s: float | None = None   # on the first token's event: when a step first ran the request
    num_cached_tokens: int = 0   # prompt tokens whose KV the prefix cache supplied (OpenAI's cached_tokens)
