"""OpenTelemetry traces: a request's trace carries its queue / prompt / decode spans and the
preemptions it suffered; batch lines get spans of their own; with an OTLP endpoint configured a
real server exports them over HTTP; unconfigured, nothing is traced."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.server.tracing import RequestTracer, install_tracer, tracing_wanted
from backfill.serving.build import build_tiny_engine
from backfill.serving.config import ServingConfig
from server_helpers import LiveServer, ServerProcess, chat_line, openai_client, upload, wait_final

KV_BLOCKS = 12   # a pool an offline request fills, so an online arrival must take blocks from it


def traced_server(tmp_path, exporter: InMemorySpanExporter, policy: str = "priority") -> LiveServer:
    probe = ServingConfig(kv_cache_gb=0.0625, max_model_len=256, policy=policy)
    kv = build_tiny_engine(probe).scheduler.kv
    block_bytes = kv.nbytes // kv.num_blocks
    serving = ServingConfig(kv_cache_gb=KV_BLOCKS * block_bytes / 2**30, max_model_len=256, policy=policy)
    engine = build_tiny_engine(serving)
    assert engine.scheduler.kv.num_blocks == KV_BLOCKS
    app = create_app(engine, ServerConfig(serving=serving, db=str(tmp_path / "s.db"), drain_timeout_s=2.0),
                     Store(tmp_path / "s.db"))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install_tracer(engine, app.state.backfill.service, RequestTracer(provider.get_tracer("test")))
    return LiveServer(app)


def spans_of(exporter: InMemorySpanExporter, root) -> dict[str, object]:
    return {span.name: span for span in exporter.get_finished_spans()
            if span.parent is not None and span.parent.span_id == root.context.span_id}


def test_a_preempted_requests_trace_carries_its_spans_and_the_preemption(tmp_path):
    exporter = InMemorySpanExporter()
    with traced_server(tmp_path, exporter) as server:
        block_size = server.state.engine.scheduler.kv.block_size
        first_token = threading.Event()
        outcome: dict[str, object] = {}

        def offline() -> None:
            # Flex: the offline class. Its prompt and output fill the pool within a few steps.
            body = {"prompt": "x" * (4 * block_size), "max_tokens": 7 * block_size, "ignore_eos": True,
                    "service_tier": "flex", "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        first_token.set()
                outcome["status"] = response.status_code

        runner = threading.Thread(target=offline)
        runner.start()
        assert first_token.wait(60)
        deadline = time.monotonic() + 60
        while server.state.engine.scheduler.kv.num_free > KV_BLOCKS - 8:   # offline holds most blocks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        online = httpx.post(f"{server.url}/v1/completions", timeout=120,
                            json={"prompt": "y" * (5 * block_size), "max_tokens": 4, "ignore_eos": True})
        assert online.status_code == 200, online.text
        runner.join(120)
        assert outcome["status"] == 200
        assert server.state.engine.scheduler.stats.preempted_requests >= 1

    roots = {span.attributes["backfill.request_class"]: span for span in exporter.get_finished_spans()
             if span.name == "llm_request"}
    assert set(roots) == {"online", "offline"}
    victim, winner = roots["offline"], roots["online"]
    preemptions = [event for event in victim.events if event.name == "preempted"]
    assert preemptions and preemptions[0].attributes["backfill.preemption.kind"] == "request_preempted"
    assert victim.start_time < preemptions[0].timestamp < victim.end_time
    assert not [event for event in winner.events if event.name == "preempted"]
    for root, tokens in ((victim, 7 * block_size), (winner, 4)):
        children = spans_of(exporter, root)
        assert set(children) == {"queue", "prompt", "decode"}
        assert all(child.context.trace_id == root.context.trace_id for child in children.values())
        queue, prompt, decode = children["queue"], children["prompt"], children["decode"]
        assert root.start_time == queue.start_time <= queue.end_time == prompt.start_time
        assert prompt.end_time == decode.start_time <= decode.end_time <= root.end_time
        assert root.attributes["gen_ai.usage.output_tokens"] == tokens
        assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # The preemption happened while the victim decoded, after the online request arrived.
    assert spans_of(exporter, victim)["decode"].start_time < preemptions[0].timestamp
    assert winner.start_time <= preemptions[0].timestamp


def test_a_caller_traceparent_makes_the_request_part_of_its_trace(tmp_path):
    exporter = InMemorySpanExporter()
    trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with traced_server(tmp_path, exporter, policy="coserve") as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
        assert response.status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    first, second = [span for span in exporter.get_finished_spans() if span.name == "llm_request"]
    assert format(first.context.trace_id, "032x") == trace_id
    assert format(first.parent.span_id, "016x") == caller_span
    assert second.parent is None and second.context.trace_id != first.context.trace_id


def test_a_request_the_engine_refuses_is_a_400_span_not_an_error_labelled_cancelled(tmp_path):
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    with traced_server(tmp_path, exporter) as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
        assert response.status_code == 400, response.text
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "llm_request"]
    assert span.status.status_code is not StatusCode.ERROR, span.status
    assert span.attributes["error.type"] == "InvalidRequestError"
    assert "gen_ai.response.finish_reasons" not in span.attributes


def test_batch_lines_get_spans_of_their_own(tmp_path):
    exporter = InMemorySpanExporter()
    with traced_server(tmp_path, exporter, policy="coserve") as server:
        client = openai_client(server.url)
        batch = client.batches.create(input_file_id=upload(client, [chat_line("a"), chat_line("b")]).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_final(client, batch.id).status == "completed"
    lines = [span for span in exporter.get_finished_spans() if span.name == "batch_line"]
    assert sorted(span.attributes["backfill.custom_id"] for span in lines) == ["a", "b"]
    assert {span.attributes["backfill.batch_id"] for span in lines} == {batch.id}
    assert all(span.attributes["backfill.request_class"] == "offline" for span in lines)
    assert all(set(spans_of(exporter, span)) == {"queue", "prompt", "decode"} for span in lines)


def test_tracing_is_off_unless_asked_for():
    config = ServerConfig()
    assert not tracing_wanted(config, {})
    assert tracing_wanted(ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces"), {})
    assert tracing_wanted(config, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_wanted(config, {"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing_wanted(config, {"OTEL_TRACES_EXPORTER": "none"})


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps the spans of every export it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        collector.spans.extend((resource_spans.resource, span) for span in scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_server_given_an_otlp_endpoint_exports_its_traces_and_its_json_log_joins_them(tmp_path, monkeypatch):
    import signal

    collector = Collector()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "backfill-test")
    server = ServerProcess(tmp_path / "s.db", None, "--otlp-traces-endpoint", collector.url,
                           "--log-format", "json", "--log-level", "info", "--served-model-name", "tiny-test"
                           ).wait_ready()
    try:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=60,
                              headers={"x-request-id": "join-me-7"})
        assert response.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200   # a probe: DEBUG, not in an INFO log
        server.signal(signal.SIGTERM)   # spans still batched are flushed on the way out
        assert server.proc.wait(timeout=60) == 0
        log = server.log()
    finally:
        server.stop()
        collector.close()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert lines and len(lines) == len([line for line in log.splitlines() if line.strip()]), log  # all JSON
    access = [line for line in lines if line["logger"] == "backfill.access"]
    assert [line["path"] for line in access] == ["/v1/completions"], access   # /health and /ready at DEBUG
    line = access[0]
    assert line["request_id"] == "join-me-7" and line["status"] == 200 and line["class"] == "online"
    assert line["model"] == "tiny-test" and line["client"].startswith("127.0.0.1:")
    joined = [span for _, span in collector.spans if span.trace_id.hex() == line["trace_id"]]
    assert sorted(span.name for span in joined) == ["decode", "llm_request", "prompt", "queue"], joined
    root = next(span for span in joined if span.name == "llm_request")
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
    assert root.kind == SpanProto.SpanKind.SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["backfill.request_id"].string_value == "join-me-7"
    assert attributes["gen_ai.request.model"].string_value == "tiny-test"
    assert attributes["gen_ai.system"].string_value == "backfill"
    assert attributes["gen_ai.operation.name"].string_value == "text_completion"
    assert attributes["gen_ai.response.id"].string_value.startswith("cmpl-")
    names = sorted(span.name for _, span in collector.spans)
    assert names == ["decode", "llm_request", "prompt", "queue"], names
    resource = collector.spans[0][0]
    assert {"key": "service.name", "value": "backfill-test"} in [
        {"key": a.key, "value": a.value.string_value} for a in resource.attributes]
    root = next(span for _, span in collector.spans if span.name == "llm_request")
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["backfill.request_class"].string_value == "online"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
