"""Per-request sampling parameters, validated where they enter the system, and what the sampler needs
of a request's token constraint (a grammar's, engine/grammar.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from backfill.errors import InvalidSamplingError

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20   # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1.0 disables top-p.
    stop_token_ids end generation without being shown; stop strings end it and are cut from
    the text (kept, with what precedes it, when include_stop_str_in_output, as vLLM's field).
    max_tokens counts output tokens.

    Penalties follow vLLM: repetition_penalty (1.0 = off) divides the positive logits and
    multiplies the negative ones of every token already in the prompt or the output;
    presence_penalty / frequency_penalty (0 = off) subtract from the logits of tokens already in
    the output, once / once per occurrence. min_p (0 = off) drops tokens whose probability is
    below min_p x the top token's. logprobs (None = off) returns the sampled token's log
    probability under the model and the logprobs most likely ones (vLLM's raw logprobs: before
    penalties and temperature).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Normalise list inputs so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop) if not isinstance(self.stop, str) else (self.stop,))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidSamplingError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidSamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidSamplingError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingError("stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidSamplingError(f"at most 16 stop strings, got {len(self.stop)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingError("stop_token_ids must be non-negative")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise InvalidSamplingError(f"{name} must be in [-2, 2], got {value!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidSamplingError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidSamplingError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidSamplingError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens seen so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def greedy_params(cls, max_tokens: int = 16, **kw) -> "SamplingParams":
        return cls(max_tokens=max_tokens, temperature=0.0, **kw)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability and the most likely alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class TokenConstraint(Protocol):
    """What the sampler needs of a per-request constraint."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the request may take next."""

    def accept(self, token_id: int) -> None:
        """Advance past the token the sampler picked."""
