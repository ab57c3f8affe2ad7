"""OpenTelemetry traces of requests and batch lines, exported over OTLP/HTTP when configured.

One trace per API request (span "llm_request", as vLLM names it) or batch line ("batch_line"),
with child spans for where its time went:

    queue    arrival -> the first step that ran it
    prompt   that step -> its first token (prefill, and any preemption before it)
    decode   first token -> last token

and a span event "preempted" each time the scheduler took it off the device or aborted a step
that carried it (ConServe §4.3-§4.4), with the kind and the time it happened.

On when --otlp-traces-endpoint is given, or any of the standard OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_TRACES_EXPORTER=otlp is set; the OTLP exporter reads
the other OTEL_* variables (headers, timeout, compression) itself, and OTEL_SERVICE_NAME names the
service (default "backfill"). Off, nothing here is imported and a request pays one `is None`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from backfill.serving.async_engine import AsyncEngine

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from backfill.server.completions import CompletionService, Generation
    from backfill.server.config import ServerConfig

OTEL_SWITCHES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_wanted(config: ServerConfig, environ: Mapping[str, str] = os.environ) -> bool:
    return bool(config.otlp_traces_endpoint or any(environ.get(name) for name in OTEL_SWITCHES)
                or environ.get("OTEL_TRACES_EXPORTER", "").lower() == "otlp")


class RequestTracer:
    """Turns the server's requests into spans; preemptions arrive from the scheduler's thread."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        # The engine's clock is monotonic; spans carry wall-clock nanoseconds.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._open: dict[str, Span] = {}   # engine request id -> its API request's span
        self._lock = threading.Lock()

    def wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def begin(self, generation: Generation, attributes: Mapping[str, Any] | None = None,
              carrier: Mapping[str, str] | None = None) -> Span:
        """The request's span, started at its arrival; call before its requests reach the engine.
        carrier: the HTTP request's headers; a W3C `traceparent` there makes the span its child."""
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        request = generation.request
        batch_line = bool(attributes and "backfill.batch_id" in attributes)
        parent = extract(carrier) if carrier is not None and "traceparent" in carrier else None
        # An API request's span is the server side of the client's call (SERVER); a batch line's
        # is work the server does on its own (INTERNAL).
        span = self.tracer.start_span("batch_line" if batch_line else "llm_request", context=parent,
                                      kind=SpanKind.INTERNAL if batch_line else SpanKind.SERVER,
                                      start_time=self.wall_ns(request.arrival_time), attributes={
            "backfill.request_class": request.request_class.value,
            "backfill.request_id": request.request_id,
            "gen_ai.system": "backfill",
            "gen_ai.operation.name": "chat",
            "gen_ai.request.max_tokens": request.sampling.max_tokens,
            "gen_ai.request.n": len(generation.requests),
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            **(attributes or {})})
        with self._lock:
            for sub in generation.requests:
                self._open[sub.request_id] = span
        return span

    def preempted(self, request_id: str, kind: str, at_s: float) -> None:
        """The scheduler preempted request_id (kind: serving/preemption.py's STEP_ABORTED or
        REQUEST_PREEMPTED), on its thread."""
        span = self._open.get(request_id)
        if span is not None:
            span.add_event("preempted", {"backfill.preemption.kind": kind, "backfill.request_id": request_id},
                           timestamp=self.wall_ns(at_s))

    def end(self, span: Span, generation: Generation, refused: BaseException | None = None) -> None:
        """Close the request's span with its queue / prompt / decode children (their times are known now).
        refused: the engine turned the request down before it ran (a 4xx answer): the span says
        why, without the ERROR status of a server failure or a cancel."""
        from opentelemetry import trace

        with self._lock:
            for sub in generation.requests:
                self._open.pop(sub.request_id, None)
        if refused is not None:
            span.set_attribute("error.type", type(refused).__name__)
            span.end()
            return
        arrival = generation.request.arrival_time
        parent = trace.set_span_in_context(span)
        stages = []
        if generation.scheduled_s is not None:
            stages.append(("queue", arrival, generation.scheduled_s))
            if generation.first_token_s is not None:
                stages.append(("prompt", generation.scheduled_s, generation.first_token_s))
        last = max((t for t in generation.last_token_s if t is not None), default=None)
        if generation.first_token_s is not None and last is not None:
            stages.append(("decode", generation.first_token_s, last))
        for name, start, stop in stages:
            self.tracer.start_span(name, context=parent, start_time=self.wall_ns(start)).end(self.wall_ns(stop))
        reasons = [reason.value if reason is not None else "cancelled" for reason in generation.finish_reasons]
        span.set_attribute("gen_ai.usage.output_tokens", generation.num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if generation.first_token_s is not None:
            span.set_attribute("backfill.ttft_ms", (generation.first_token_s - arrival) * 1e3)
        if any(reason in ("error", "cancelled") for reason in reasons):
            span.set_status(trace.Status(trace.StatusCode.ERROR, ", ".join(reasons)))
        span.end()


def install_tracer(engine: AsyncEngine, service: CompletionService, tracer: RequestTracer) -> None:
    """Trace service's requests and the engine's preemptions with tracer."""
    service.tracer = tracer
    engine.add_preemption_observer(tracer.preempted)


def install_tracing(engine: AsyncEngine, service: CompletionService, config: ServerConfig) -> None:
    """Export traces over OTLP/HTTP when the config or the environment asks for them (else nothing)."""
    if not tracing_wanted(config):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "backfill")})
    provider = TracerProvider(resource=resource)   # flushed at exit (shutdown_on_exit)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)))
    install_tracer(engine, service, RequestTracer(provider.get_tracer("backfill.server")))
