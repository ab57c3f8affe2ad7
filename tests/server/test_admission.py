"""Admission by predicted TTFT: the prediction from the queue ahead, the SLO decision, Retry-After
from the drain time, and a live server shedding with 429 while it keeps serving what it admitted."""

from __future__ import annotations

import httpx
import pytest

from backfill.policy.config import CoServeConfig
from backfill.policy.latency_model import BatchShape
from backfill.server.admission import QueuedRequest, TtftAdmission, retry_after_header
from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.types import SLO
from backfill.serving.build import build_tiny_engine
from backfill.serving.config import ServingConfig

from server_helpers import LiveServer, assert_error, sample_value


def linear_ms(shape: BatchShape) -> float:
    """10 ms a step plus 1 ms per token."""
    return 10.0 + shape.num_tokens


def admission(**kw) -> TtftAdmission:
    return TtftAdmission(linear_ms, ttft_slo_ms=kw.pop("slo", 500.0), max_batch_tokens=kw.pop("cap", 100), **kw)


def test_prediction_counts_the_prompts_ahead_in_capped_steps_with_decodes():
    policy = admission()
    queue = [QueuedRequest(150, False), QueuedRequest(50, True, num_decoding=2)]
    # 150 waiting + 100 new = 250 prefill tokens: steps of 100, 100, 50, each with 2 decodes riding along.
    assert policy.decide(100, queue).predicted_ttft_ms == pytest.approx((10 + 102) * 2 + (10 + 52))


def test_over_the_slo_is_refused_with_the_drain_time():
    policy = admission(slo=200.0)
    queue = [QueuedRequest(300, False)]
    decision = policy.decide(50, queue)
    assert not decision.admit and decision.predicted_ttft_ms > 200
    assert decision.retry_after_ms == pytest.approx(max(decision.predicted_ttft_ms - 200, 330.0))
    assert policy.decide(50, []).admit                # an idle server takes any request
    assert admission(slo=200.0, ttft_share=2.0).decide(50, queue).admit


def test_decoding_batch_is_bounded_by_the_tpot_slo():
    # A step with 40 decodes takes 50 ms: a 41st decoding request would pass a 45 ms TPOT SLO.
    policy = admission(slo=10_000.0, tpot_slo_ms=45.0)
    decoding = [QueuedRequest(10, True, num_decoding=1, remaining_tokens=20 + i) for i in range(40)]
    decision = policy.decide(10, decoding)
    assert not decision.admit and decision.predicted_ttft_ms < 10_000   # TTFT alone would admit it
    assert decision.retry_after_ms == pytest.approx(20 * 51.0)          # the soonest decode to end
    assert policy.decide(10, decoding[:30]).admit


def test_a_full_batch_adds_the_wait_for_a_sequence_slot():
    policy = admission(slo=10_000.0, max_batch_seqs=4)
    decoding = [QueuedRequest(10, True, remaining_tokens=n) for n in (30, 5, 12, 40)]
    free = policy.decide(10, decoding[:3]).predicted_ttft_ms
    # Four decode in a 4-sequence batch: the new one waits for the soonest to end (5 steps of 15 ms).
    assert policy.decide(10, decoding).predicted_ttft_ms == pytest.approx(free - 13 + 14 + 5 * 15.0)


def test_measured_ttft_corrects_the_prediction():
    policy = admission(slo=300.0)
    queue = [QueuedRequest(100, False)]
    before = policy.decide(100, queue).predicted_ttft_ms
    for _ in range(30):       # the machine is twice as slow as the profile says
        policy.observe(predicted_ttft_ms=policy.correction * 100.0, measured_ttft_ms=200.0)
    assert policy.correction == pytest.approx(2.0, rel=0.01)
    assert policy.decide(100, queue).predicted_ttft_ms == pytest.approx(2 * before, rel=0.01)
    for _ in range(100):
        policy.observe(policy.correction * 100.0, 10_000.0)
    assert policy.correction == 5.0                   # bounded


def test_retry_after_header_rounds_up_to_whole_seconds():
    assert retry_after_header(1200.0) == {"Retry-After": "2", "retry-after-ms": "1200"}
    assert retry_after_header(0.3)["Retry-After"] == "1"


@pytest.fixture
def strict_server(tmp_path):
    # The tiny engine's profile says a step takes at least 1 ms: a 0.5 ms SLO fits only an idle server.
    serving = ServingConfig(kv_cache_gb=0.0625, max_model_len=512,
                            coserve=CoServeConfig(slo=SLO(ttft_ms=0.5, tpot_ms=100.0)))
    db = tmp_path / "server.db"
    app = create_app(build_tiny_engine(serving), ServerConfig(serving=serving, db=str(db), drain_timeout_s=2.0),
                     Store(db))
    with LiveServer(app) as server:
        yield server


def test_live_server_sheds_by_predicted_ttft_with_retry_after(strict_server):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=strict_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            while '"content":"' not in next(lines).replace(" ", "").replace('"content":""', ""):
                pass   # the first request decodes now
            refused = http.post("/v1/chat/completions", json={**body, "stream": False})
            error = assert_error(refused, 429, code="slo_overload")
            assert "predicted" in error["message"]
            assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) >= 1
        metrics = http.get("/metrics").text
    assert sample_value(metrics, "backfill_requests_rejected_total", **{"class": "online", "reason": "slo_overload"}) == 1
    assert sample_value(metrics, "backfill_requests_rejected_total", **{"class": "online", "reason": "queue_full"}) == 0
    assert sample_value(metrics, "backfill_request_queue_time_seconds_count", **{"class": "online"}) == 1


def test_admission_off_with_infinite_share(tmp_path):
    serving = ServingConfig(kv_cache_gb=0.0625, max_model_len=512,
                            coserve=CoServeConfig(slo=SLO(ttft_ms=0.5, tpot_ms=100.0)))
    db = tmp_path / "server.db"
    config = ServerConfig(serving=serving, db=str(db), admission_ttft_share=float("inf"))
    app = create_app(build_tiny_engine(serving), config, Store(db))
    assert app.state.backfill.admission is None
    app.state.backfill.store.close()


def test_requests_waiting_past_their_prediction_slow_the_prediction_at_once():
    policy = admission(slo=1000.0)
    on_time = [QueuedRequest(50, False, waited_ms=200.0, predicted_ttft_ms=300.0)]
    base = policy.decide(50, on_time).predicted_ttft_ms
    assert policy.queue_lag(on_time) == 1.0
    # One waiting request has waited 3x its prediction: the queue runs 3x slower than predicted.
    late = on_time + [QueuedRequest(50, False, waited_ms=600.0, predicted_ttft_ms=200.0)]
    assert policy.queue_lag(late) == pytest.approx(3.0)
    assert policy.decide(50, late).predicted_ttft_ms == pytest.approx(3.0 * policy.decide(50, late[:1] * 2)
                                                                      .predicted_ttft_ms)
    assert base < 1000.0
    # A wait under a quarter of the limit says nothing yet; a decoding request is not waiting.
    assert policy.queue_lag([QueuedRequest(50, False, waited_ms=200.0, predicted_ttft_ms=20.0)]) == 1.0
    assert policy.queue_lag([QueuedRequest(50, True, waited_ms=900.0, predicted_ttft_ms=20.0)]) == 1.0


def test_a_late_queue_turns_an_admission_into_a_429_with_a_longer_retry():
    policy = admission(slo=500.0)
    queue = [QueuedRequest(200, False, waited_ms=400.0, predicted_ttft_ms=400.0)]
    assert policy.decide(100, queue).admit               # (10+100)*3 = 330 ms, on time so far
    late = [QueuedRequest(200, False, waited_ms=800.0, predicted_ttft_ms=400.0)]
    decision = policy.decide(100, late)
    assert not decision.admit and decision.predicted_ttft_ms == pytest.approx(2 * 330.0)
    assert decision.retry_after_ms == pytest.approx(2 * 220.0)   # the 200 tokens ahead, at the late pace


def test_a_cached_prefix_is_predicted_as_only_its_uncached_rest(tmp_path):
    """Admission charges an online prompt only the tokens the prefix cache does not hold, as the policy does."""
    serving = ServingConfig(kv_cache_gb=0.0625, max_model_len=512,
                            coserve=CoServeConfig(slo=SLO(ttft_ms=1e6, tpot_ms=1e6)))
    db = tmp_path / "server.db"
    app = create_app(build_tiny_engine(serving), ServerConfig(serving=serving, db=str(db)), Store(db))
    state = app.state.backfill
    shared = [5 + (i * 7) % 200 for i in range(300)]
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": shared + [1], "max_tokens": 1}).status_code == 200
        block = state.engine.kv_block_size
        for tail, cached in (([2, 3], 300 // block * block), ([], (299 // block) * block)):
            prepared = state.service.prepare("text", {"prompt": shared + tail, "max_tokens": 1})
            admitted = state.admit(prepared)
            state.release("online")
            assert admitted.num_prompt_tokens == len(shared) + len(tail) - cached > 0
            assert admitted.predicted_ttft_ms > 0
        fresh = state.service.prepare("text", {"prompt": [7] * 300, "max_tokens": 1})
        assert state.admit(fresh).num_prompt_tokens == 300
        state.release("online")
