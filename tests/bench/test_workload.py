import numpy as np
import pytest

from backfill.bench.arrivals import poisson_arrivals
from backfill.bench.lengths import FixedLength, UniformLength
from backfill.bench.prompts import PromptSource
from backfill.bench.traces import Trace, TraceRecord
from backfill.bench.workload import (BenchRequest, OfflineBacklog, OfflineSpec, Workload, build_workload,
                                     requests_from_trace)
from backfill.errors import WorkloadError
from backfill.types import RequestClass


def test_build_workload_online_and_backlog(bpe):
    src = PromptSource(bpe, seed=0)
    arrivals = poisson_arrivals(5.0, seed=0, duration_s=4.0)
    wl = build_workload(src, arrivals, UniformLength(8, 16), FixedLength(4), seed=0,
                        offline=OfflineSpec(2, 5, FixedLength(32), FixedLength(8)), duration_s=4.0)
    assert len(wl.requests) == len(arrivals) and wl.online == wl.requests
    assert [r.arrival_s for r in wl.requests] == list(arrivals)
    assert all(8 <= r.prompt_tokens <= 16 and r.max_tokens == 4 for r in wl.requests)
    (backlog,) = wl.offline_backlogs
    assert backlog.concurrency == 2 and len(backlog.requests) == 5
    assert all(r.request_class is RequestClass.OFFLINE and r.arrival_s is None and r.prompt_tokens == 32
               for r in backlog.requests)
    texts = [r.prompt_text for r in wl.all_requests()]
    assert len(set(texts)) == len(texts)
    again = build_workload(src, arrivals, UniformLength(8, 16), FixedLength(4), seed=0,
                           offline=OfflineSpec(2, 5, FixedLength(32), FixedLength(8)), duration_s=4.0)
    assert again.all_requests() == wl.all_requests()


def test_open_loop_offline_requests(bpe):
    src = PromptSource(bpe, seed=0)
    wl = build_workload(src, [0.5, 1.5], FixedLength(8), FixedLength(2), seed=1,
                        offline_arrivals_s=np.array([0.0, 1.0]))
    assert [r.request_class.value for r in wl.requests] == ["offline", "online", "offline", "online"]


def test_requests_from_trace_clip_lengths(bpe):
    src = PromptSource(bpe, seed=0)
    trace = Trace((TraceRecord(0.0, 5000, 10), TraceRecord(1.5, 20, 900)), "mem", "azure")
    reqs = requests_from_trace(src, trace, max_prompt_tokens=100, max_output_tokens=64)
    assert [(r.arrival_s, r.prompt_tokens, r.max_tokens) for r in reqs] == [(0.0, 100, 10), (1.5, 20, 64)]


def test_validation_errors(bpe):
    ok = BenchRequest("a", 0.0, "online", (1, 2), "x", 4)
    with pytest.raises(WorkloadError, match="empty prompt"):
        BenchRequest("b", 0.0, "online", (), "", 4)
    with pytest.raises(WorkloadError, match="max_tokens"):
        BenchRequest("b", 0.0, "online", (1,), "x", 0)
    with pytest.raises(WorkloadError, match="arrival_s"):
        BenchRequest("b", -1.0, "online", (1,), "x", 1)
    with pytest.raises(WorkloadError, match="unique"):
        Workload((ok, ok))
    with pytest.raises(WorkloadError, match="closed-loop"):
        OfflineBacklog(1, (ok,))
    with pytest.raises(WorkloadError, match="duration_s"):
        Workload((), (OfflineBacklog(1, (BenchRequest("c", None, "offline", (1,), "x", 1),)),))
    with pytest.raises(WorkloadError, match="arrival_s"):
        Workload((BenchRequest("c", None, "offline", (1,), "x", 1),))
