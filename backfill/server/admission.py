"""Admission of online requests by predicted time to first token, against the TTFT SLO.

A request is admitted while the TTFT it is predicted to get is within the SLO (times
admission_ttft_share), and while one more sequence decoding keeps a step within the TPOT SLO;
otherwise it gets 429 with Retry-After, the predicted time for the work ahead of it to drain. A
queue length says nothing about time: 200 short prompts may meet the SLO where 20 long ones cannot.

Why the decode check: TTFT alone admits whenever the prefill queue is short, and every admitted
request then decodes for its whole output. Under a burst the decoding batch grows until one step
takes the whole TTFT SLO; when the burst ends, that backlog still runs for a whole output length
of slow steps, and requests arriving after the burst wait behind it (their TTFT over the SLO).
Bounding the decoding batch by the TPOT SLO keeps every step short, during the burst and after.

The prediction is the latency profile the scheduler already has (ConServe §4.5), applied to the
queue ahead: the prompt tokens of admitted online requests still waiting for their first token,
plus this one's, run in steps of at most max_batch_tokens, each step also carrying one token per
online request decoding. Measured TTFTs correct it: the ratio of measured to predicted TTFT is
tracked, so a profile measured on a quieter machine, or steps the model does not see (offline
riders, preemption), do not let the queue grow past the SLO. That ratio is learnt only as requests
finish, a whole output after they were admitted, so under a burst it lags; the requests still
waiting correct it at once: one that has waited longer than it was predicted to says the queue runs
slower than predicted by that factor, and the new request, behind it, is predicted that much later.

Policy, not mechanism: a plain object over the server's view of what it admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from backfill.policy.latency_model import BatchShape

# How fast the measured/predicted ratio follows new measurements, and the range it stays in.
CORRECTION_WEIGHT = 0.2
CORRECTION_RANGE = (0.2, 5.0)
# A waiting request corrects the prediction once it has waited this share of the TTFT limit: below
# it, waits are too short for their ratio to the prediction to mean anything.
LAG_MIN_SHARE = 0.25


@dataclass(frozen=True)
class QueuedRequest:
    """An admitted online request as admission sees it."""

    num_prompt_tokens: int      # all its choices' prompts together
    first_token: bool           # it has produced its first token (it is decoding now)
    num_decoding: int = 1       # its choices decoding, once they have started
    remaining_tokens: int = 0   # the fewest output tokens any of its choices may still generate
    waited_ms: float = 0.0      # since it arrived
    predicted_ttft_ms: float = 0.0   # what admission predicted for it (0: not predicted)


@dataclass(frozen=True)
class Decision:
    admit: bool
    predicted_ttft_ms: float
    retry_after_ms: float = 0.0


class TtftAdmission:
    def __init__(self, estimate_ms: Callable[[BatchShape], float], ttft_slo_ms: float, max_batch_tokens: int,
                 ttft_share: float = 1.0, tpot_slo_ms: float = math.inf, max_batch_seqs: int | None = None) -> None:
        self.estimate_ms = estimate_ms
        self.max_batch_seqs = max_batch_seqs
        self.ttft_slo_ms = ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms
        self.max_batch_tokens = max_batch_tokens
        self.ttft_share = ttft_share
        self.correction = 1.0

    def prefill_ms(self, prefill_tokens: int, num_decoding: int) -> float:
        """Steps to run prefill_tokens, each with num_decoding decodes riding along."""
        total = 0.0
        left = prefill_tokens
        while left > 0:
            chunk = min(left, self.max_batch_tokens)
            total += self.estimate_ms(BatchShape(chunk + num_decoding))
            left -= chunk
        return total

    def decide(self, num_prompt_tokens: int, admitted: Iterable[QueuedRequest]) -> Decision:
        admitted = list(admitted)
        ahead = sum(r.num_prompt_tokens for r in admitted if not r.first_token)
        decoding = sum(r.num_decoding for r in admitted if r.first_token)
        predicted = self.correction * self.prefill_ms(ahead + num_prompt_tokens, decoding)
        limit = self.ttft_slo_ms * self.ttft_share
        decode_step_ms = self.correction * self.estimate_ms(BatchShape(decoding + 1))
        predicted += self._slot_wait_steps(admitted) * decode_step_ms
        lag = self.queue_lag(admitted)
        predicted *= lag
        fits_ttft = predicted <= limit
        fits_tpot = decoding == 0 or decode_step_ms <= self.tpot_slo_ms
        if (fits_ttft and fits_tpot) or not admitted:   # an idle server takes any request
            return Decision(True, predicted)
        # Retry once the queue ahead has drained enough for this request to fit the SLO ...
        drain = 0.0
        if not fits_ttft:
            drain = max(predicted - limit, lag * self.correction * self.prefill_ms(ahead, decoding))
        if not fits_tpot:   # ... and a decoding request has finished (at the latest: its max_tokens)
            soonest = min((r.remaining_tokens for r in admitted if r.first_token), default=1)
            drain = max(drain, max(soonest, 1) * decode_step_ms)
        return Decision(False, predicted, drain)

    def queue_lag(self, admitted: list[QueuedRequest]) -> float:
        """How much slower than predicted the queue runs now (at least 1): the largest ratio of a
        waiting request's wait so far to its predicted TTFT, among those that waited long enough."""
        floor_ms = LAG_MIN_SHARE * self.ttft_slo_ms * self.ttft_share
        return max([1.0, *(r.waited_ms / r.predicted_ttft_ms for r in admitted
                    if not r.first_token and r.predicted_ttft_ms > 0 and r.waited_ms >= floor_ms)])

    def _slot_wait_steps(self, admitted: list[QueuedRequest]) -> int:
        """Decode steps until the batch has a sequence slot for this request: a step runs at most
        max_batch_seqs sequences, so past that a new request waits for decodes to end."""
        if self.max_batch_seqs is None:
            return 0
        waiting = sum(1 for r in admitted if not r.first_token)
        remaining = sorted(r.remaining_tokens for r in admitted if r.first_token for _ in range(r.num_decoding))
        excess = len(remaining) + waiting + 1 - self.max_batch_seqs
        if excess <= 0:
            return 0
        return remaining[min(excess, len(remaining)) - 1] if remaining else 0

    def observe(self, predicted_ttft_ms: float, measured_ttft_ms: float) -> None:
        """A request admitted with this prediction got its first token after measured_ttft_ms."""
        if predicted_ttft_ms <= 0 or measured_ttft_ms <= 0:
            return
        ratio = measured_ttft_ms / (predicted_ttft_ms / self.correction)
        updated = (1 - CORRECTION_WEIGHT) * self.correction + CORRECTION_WEIGHT * ratio
        self.correction = min(max(updated, CORRECTION_RANGE[0]), CORRECTION_RANGE[1])


def retry_after_header(retry_after_ms: float) -> dict[str, str]:
    """Retry-After in whole seconds (at least 1), and retry-after-ms, which openai-python reads first."""
    return {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1e3))),
            "retry-after-ms": str(max(1, round(retry_after_ms)))}
