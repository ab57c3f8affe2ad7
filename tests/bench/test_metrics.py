import json

import pytest

from backfill.bench.metrics import PreemptionEvent, RequestRecord, Summary, compute_metrics
from backfill.errors import WorkloadError
from backfill.types import SLO, RequestClass

ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE


def _records() -> list[RequestRecord]:
    a = RequestRecord("a", ON, scheduled_s=0.0, send_s=0.0, first_token_s=0.1, chunk_times_s=[0.1, 0.15, 0.25],
                      chunk_tokens=[1, 1, 2], end_s=0.25, prompt_tokens=10, output_tokens=4)
    b = RequestRecord("b", ON, scheduled_s=0.98, send_s=1.0, first_token_s=1.3, chunk_times_s=[1.3],
                      chunk_tokens=[1], end_s=1.3, prompt_tokens=10, output_tokens=1)
    c = RequestRecord("c", ON, scheduled_s=1.5, send_s=1.5, end_s=1.6, error="TargetError: boom")
    d = RequestRecord("d", OFF, send_s=0.0, first_token_s=0.5, chunk_times_s=[0.5, 1.2, 2.5], chunk_tokens=[1, 1, 1],
                      end_s=2.6, output_tokens=3, cancelled=True)
    return [a, b, c, d]


def test_per_request_definitions():
    a, b, c, d = _records()
    assert a.ttft_ms == pytest.approx(100) and a.e2e_ms == pytest.approx(250)
    assert a.tpot_ms == pytest.approx(50)  # (250 - 100) / (4 - 1)
    assert a.itls_ms == pytest.approx([50, 100])
    assert b.tpot_ms is None and b.send_lag_ms == pytest.approx(20)
    assert not c.ok and c.e2e_ms is None and c.ttft_ms is None
    assert not d.ok and d.send_lag_ms is None


def test_compute_metrics_on_a_hand_made_timeline():
    m = compute_metrics(_records(), slo=SLO(ttft_ms=200, tpot_ms=60),
                        preemption_events=[PreemptionEvent(0.5, 2.0), (1.0, 4.0)],
                        engine_samples=[(0.2, {"kv": 0.5, "q": 1}), (0.7, {"kv": 0.7, "label": "x"}), (2.1, {"q": 3})])
    assert m.duration_s == pytest.approx(1.6)  # the last online request ended at 1.6 s
    assert (m.online.requests, m.online.completed, m.online.failed, m.online.cancelled) == (3, 2, 1, 0)
    assert (m.offline.requests, m.offline.completed, m.offline.failed, m.offline.cancelled) == (1, 0, 0, 1)
    assert m.online.output_tokens == 5 and m.offline.output_tokens == 2  # offline token at 2.5 s is outside
    assert m.online.tokens_per_s == pytest.approx(5 / 1.6)
    assert m.offline.tokens_per_s == pytest.approx(2 / 1.6)
    assert m.total_tokens_per_s == pytest.approx(7 / 1.6)
    assert m.online.requests_per_s == pytest.approx(2 / 1.6)
    assert m.online.ttft_ms == Summary(2, pytest.approx(200), pytest.approx(200), pytest.approx(280),
                                       pytest.approx(298), pytest.approx(300))
    assert m.online.tpot_ms.count == 1 and m.online.tpot_ms.mean == pytest.approx(50)
    assert m.online.itl_ms.mean == pytest.approx(75) and m.online.itl_ms.max == pytest.approx(100)
    assert m.online.e2e_ms.mean == pytest.approx(275)
    assert m.offline.ttft_ms.count == 0 and m.offline.ttft_ms.p99 is None
    assert m.goodput_rps == pytest.approx(1 / 1.6)  # only "a" meets both SLOs; "b" misses TTFT
    assert m.slo_attainment == pytest.approx(1 / 3)
    assert m.preemptions == 2 and m.preemptions_per_online_request == pytest.approx(2 / 3)
    assert m.preemption_latency_ms.p50 == pytest.approx(3.0) and m.preemption_latency_ms.p99 == pytest.approx(3.98)
    assert m.send_lag_ms.count == 3 and m.send_lag_ms.max == pytest.approx(20)
    assert m.send_lag_ms.p50 == pytest.approx(0)
    ts = m.timeseries
    assert ts.t_s == [0.0, 1.0, 2.0]
    assert ts.tokens_per_s == {"online": [4.0, 1.0, 0.0], "offline": [1.0, 1.0, 1.0]}
    assert ts.engine == {"kv": [pytest.approx(0.6), None, None], "q": [1.0, None, 3.0]}
    assert m.to_dict()["online"]["ttft_ms"]["p90"] == pytest.approx(280)


def test_explicit_window_bucket_and_record_preemptions():
    recs = _records()
    recs[0].num_preemptions = 1
    recs[3].num_preemptions = 2
    m = compute_metrics(recs, duration_s=3.0, bucket_s=0.5)
    assert m.offline.output_tokens == 3 and m.offline.tokens_per_s == pytest.approx(1.0)
    assert m.preemptions == 3 and m.preemption_latency_ms.count == 0
    assert m.goodput_rps is None and m.slo is None
    assert len(m.timeseries.t_s) == 6 and m.timeseries.tokens_per_s["online"][0] == 8.0


def test_errors():
    with pytest.raises(WorkloadError):
        compute_metrics([])
    with pytest.raises(WorkloadError, match="duration_s"):
        compute_metrics([RequestRecord("x", ON, send_s=0.0)])
    with pytest.raises(WorkloadError):
        compute_metrics(_records(), bucket_s=0)


def test_records_round_trip_through_json():
    for record in _records():
        assert RequestRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    with pytest.raises(WorkloadError):
        RequestRecord.from_json({"request_id": "x", "request_class": "batch"})
    with pytest.raises(WorkloadError):
        RequestRecord.from_json({"request_class": "online"})
