"""The server's shared state: the engine, the store, the workers, and admission of online
requests (queue caps, predicted TTFT). Every route module reads it; create_app builds it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from backfill.server.admission import QueuedRequest, TtftAdmission, retry_after_header
from backfill.server.batches import BatchWorker
from backfill.server.completions import CompletionService, Generation, Prepared
from backfill.server.config import ServerConfig
from backfill.server.errors import APIError
from backfill.server.fine_tuning import FineTuningWorker
from backfill.server.metrics import CLASSES, ServerMetrics
from backfill.server.store import Store
from backfill.errors import BackfillError
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.config import ServingConfig


DRAIN_CUT_MARGIN_S = 1.0     # requests are ended this long before the drain deadline (at most a quarter of it)


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    store: Store
    service: CompletionService
    metrics: ServerMetrics
    worker: BatchWorker
    fine_tuning: FineTuningWorker
    started_at: int = field(default_factory=lambda: int(time.time()))
    in_flight: dict[str, int] = field(default_factory=lambda: {cls: 0 for cls in CLASSES})
    draining: bool = False
    drain_deadline_s: float | None = None     # monotonic: the process exits by then
    refuse_from_s: float | None = None        # monotonic: new requests get 503 from then (after the pre-stop delay)
    drain_cut: bool = False                   # requests still running near the deadline were ended
    # Called with (class, requests in flight) on every change: a node's model server reports its
    # online lifecycle to the node runtime's gate from here (backfill/node/model_server.py).
    on_in_flight_change: Callable[[str, int], None] | None = None
    # True while something outside the server holds offline work back: a node's gate
    # (backfill/node/model_server.py); the live page gives it as the reason offline work waits.
    offline_paused: Callable[[], bool] | None = None
    admission: TtftAdmission | None = None
    # Admitted online requests and the TTFT predicted for each when it was admitted.
    online: dict[Generation, Admitted] = field(default_factory=dict)
    # Every HTTP request's generation in flight (online and flex): what the drain deadline ends.
    generations: set[Generation] = field(default_factory=set)

    @property
    def served_model(self) -> str:
        return self.service.served_model

    @property
    def limit_bytes(self) -> int:
        """The largest request body (--max-body-mb), bytes."""
        return int(self.config.max_body_mb * 2**20)

    def check_not_draining(self) -> None:
        """503 with Retry-After once the drain refuses new work (after the pre-stop delay)."""
        if self.draining and time.monotonic() >= self.refuse_from_s:
            raise APIError(503, "the server is shutting down; retry (another replica, or this one once restarted)",
                           code="service_unavailable",
                           headers={"Connection": "close"})   # Retry-After: APIError's default

    def begin_drain(self) -> None:
        """SIGTERM: /ready says 503 at once; new requests get 503 once the pre-stop delay has passed;
        the batch worker starts no new lines; what is in flight runs on (drain_finished says until when)."""
        if not self.draining:
            now = time.monotonic()
            self.draining = True
            self.refuse_from_s = now + self.config.drain_pre_stop_s
            self.drain_deadline_s = now + self.config.drain_timeout_s
            self.worker.stop_accepting()

    def drain_finished(self) -> bool:
        """Polled while draining: whether the server may stop listening and shut down now.

        Done once nothing is in flight (and the pre-stop delay has passed). Requests still running
        when the deadline is near are ended (Generation.end_now: a stream gets an error chunk and
        [DONE], a non-streamed request a JSON 503), early enough that their answers and the
        shutdown fit in the deadline; batch lines still running then stay pending in the
        database and run again after a restart."""
        now = time.monotonic()
        online_busy = any(self.in_flight.values())
        if now < self.refuse_from_s:
            return False
        if not online_busy and self.worker.in_flight == 0:
            return True
        cut_at = self.drain_deadline_s - min(DRAIN_CUT_MARGIN_S, self.config.drain_timeout_s / 4)
        if now < cut_at:
            return False
        if not self.drain_cut:
            self.drain_cut = True
            for generation in list(self.generations):
                generation.end_now()
        return not online_busy or now >= self.drain_deadline_s

    def admit(self, prepared: Prepared) -> Admitted:
        """Take the request or raise 503 / 429; returns what admission predicted for it."""
        request_class = prepared.request.request_class.value
        self.check_not_draining()
        if self.in_flight[request_class] >= self.config.max_online_queue:
            self.metrics.observe_rejected(request_class, "queue_full")
            raise APIError(429, f"too many {request_class} requests in flight "
                                f"({self.config.max_online_queue}); retry later", code="queue_full")
        admitted = Admitted()
        if self.admission is not None and prepared.request.request_class is RequestClass.ONLINE:
            # A prompt whose prefix is cached computes only the rest (the policy charges it the same way).
            num_prompt = uncached_prompt_tokens(self.engine, prepared.request) * len(prepared.requests)
            now = time.monotonic()
            decision = self.admission.decide(num_prompt, (queued_view(g, a, now) for g, a in self.online.items()))
            if not decision.admit:
                self.metrics.observe_rejected(request_class, "slo_overload")
                raise APIError(429, f"the server is at capacity: this request's time to first token is predicted "
                                    f"at {decision.predicted_ttft_ms:.0f} ms, over the {self.admission.ttft_slo_ms:g} ms "
                                    f"SLO; retry after the Retry-After header's seconds", code="slo_overload",
                               headers=retry_after_header(decision.retry_after_ms))
            admitted = Admitted(decision.predicted_ttft_ms, num_prompt)
        self.in_flight[request_class] += 1
        if self.on_in_flight_change is not None:
            self.on_in_flight_change(request_class, self.in_flight[request_class])
        return admitted

    def track(self, generation: Generation, admitted: Admitted) -> None:
        self.generations.add(generation)
        if self.drain_cut:   # admitted just before the drain refused new work, after the cut
            generation.end_now()
        if generation.request.request_class is RequestClass.ONLINE:
            self.online[generation] = admitted

    def release(self, request_class: str, generation: Generation | None = None) -> None:
        self.in_flight[request_class] -= 1
        if self.on_in_flight_change is not None:
            self.on_in_flight_change(request_class, self.in_flight[request_class])
        self.generations.discard(generation)
        admitted = self.online.pop(generation, None) if generation is not None else None
        if admitted is not None and admitted.predicted_ttft_ms and self.admission is not None \
                and generation.first_token_s is not None:
            self.admission.observe(admitted.predicted_ttft_ms,
                                   (generation.first_token_s - generation.request.arrival_time) * 1e3)


@dataclass(frozen=True)
class Admitted:
    """What admission predicted for an online request it took."""

    predicted_ttft_ms: float = 0.0        # 0: not predicted
    num_prompt_tokens: int | None = None  # its choices' prompt tokens not in the prefix cache at arrival


def uncached_prompt_tokens(engine: AsyncEngine, request: GenerationRequest) -> int:
    """The prompt tokens a request will compute: those the prefix cache does not hold now."""
    try:
        return len(request.prompt_token_ids) - engine.cached_prompt_tokens(request)
    except BackfillError:   # an unknown adapter: submitting the request reports it
        return len(request.prompt_token_ids)


def queued_view(generation: Generation, admitted: Admitted | None = None,
                now_s: float | None = None) -> QueuedRequest:
    now_s = time.monotonic() if now_s is None else now_s
    admitted = admitted or Admitted()
    unfinished = [i for i, reason in enumerate(generation.finish_reasons) if reason is None]
    max_tokens = generation.request.sampling.max_tokens
    num_prompt = admitted.num_prompt_tokens if admitted.num_prompt_tokens is not None else \
        len(generation.request.prompt_token_ids) * len(generation.requests)
    return QueuedRequest(num_prompt,
                         generation.first_token_s is not None, len(unfinished),
                         min((max_tokens - generation.output_tokens[i] for i in unfinished), default=0),
                         (now_s - generation.request.arrival_time) * 1e3, admitted.predicted_ttft_ms)


def make_admission(engine: AsyncEngine, config: ServerConfig) -> TtftAdmission | None:
    """Admission by predicted TTFT (and decode step time) where the policy has a latency profile (coserve);
    None: queue length only."""
    latency = engine.policy.latency
    if latency is None or math.isinf(config.admission_ttft_share):
        return None
    serving = config.serving or ServingConfig()
    limits = serving.batch_limits
    correction_for = engine.policy.correction_for

    def estimate_ms(shape, _raw=latency.estimate_ms):  # the profile as the policy corrects it from measured steps
        return correction_for(shape.num_tokens) * _raw(shape)

    return TtftAdmission(estimate_ms, serving.coserve.slo.ttft_ms, limits.max_batch_tokens,
                         config.admission_ttft_share, serving.coserve.slo.tpot_ms, limits.max_batch_seqs)
