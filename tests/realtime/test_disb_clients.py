import pytest

from backfill.bench.disb import parse_disb
from backfill.errors import WorkloadError


def test_dnn_clients_need_no_lengths_and_trace_clients_replay_times():
    w = parse_disb({"name": "apollo", "duration_s": 2, "clients": [
        {"name": "rt", "model": "vgg19", "priority": "real-time", "arrival": "trace", "arrivals_s": [0.0, 0.1, 0.25]},
        {"name": "be", "model": "resnet152", "priority": "best-effort", "arrival": "closed-loop", "concurrency": 1}]})
    assert w.clients[0].arrivals_s == (0.0, 0.1, 0.25)
    assert parse_disb(w.to_json()) == w
    with pytest.raises(WorkloadError, match="missing field 'prompt_len'"):
        parse_disb({"clients": [{"name": "x", "model": "default", "priority": "real-time", "arrival": "uniform",
                                 "rate_per_s": 1}]})
    with pytest.raises(WorkloadError, match="sorted"):
        parse_disb({"clients": [{"name": "x", "model": "vgg19", "priority": "real-time", "arrival": "trace",
                                 "arrivals_s": [0.3, 0.1]}]})
