import asyncio
import time

import pytest
from bench_helpers import FakeOpenAIServer

from backfill.bench.driver import run_workload
from backfill.bench.http_target import HttpTarget
from backfill.bench.metrics import compute_metrics
from backfill.bench.workload import BenchRequest, OfflineBacklog, Workload
from backfill.errors import WorkloadError
from backfill.types import RequestClass


def _online(n: int, spacing_s: float, max_tokens: int, fail: set[int] = frozenset()) -> tuple[BenchRequest, ...]:
    return tuple(BenchRequest(f"on{i}", 0.02 + i * spacing_s, "online", (1, 2, 3),
                              ("FAIL " if i in fail else "") + "a b c", max_tokens) for i in range(n))


def _backlog(n: int, concurrency: int, max_tokens: int) -> OfflineBacklog:
    return OfflineBacklog(concurrency, tuple(BenchRequest(f"off{i}", None, "offline", (4, 5), "d e", max_tokens)
                                             for i in range(n)))


async def _run(server, workload, **kw):
    target = HttpTarget(server.base_url, "m")
    try:
        return await run_workload(target, workload, progress=False, **kw)
    finally:
        await target.aclose()


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(pace_s=0.01) as s:
        yield s


def test_open_loop_online_with_closed_loop_backlog(server):
    # Offline streams of 2 s: the run's end (about 0.3 s) cuts them far from their end, so the server
    # sees each close (a stream a token from its end could finish before the close reached it).
    wl = Workload(_online(8, 0.02, 5, fail={3}), (_backlog(100, 2, 200),))
    before = time.monotonic()
    result = asyncio.run(_run(server, wl, sample_interval_s=0.05))
    assert before < result.t0_monotonic_s < before + 1.0
    online = [r for r in result.records if r.request_class is RequestClass.ONLINE]
    offline = [r for r in result.records if r.request_class is RequestClass.OFFLINE]
    assert len(online) == 8
    failed = [r for r in online if r.error]
    assert [r.request_id for r in failed] == ["on3"] and "HTTP 400" in failed[0].error
    for r in online:
        assert r.send_lag_ms is not None and r.send_s >= r.scheduled_s  # never sent early
        if r.request_id != "on3":
            assert r.ok and r.output_tokens == 5 and len(r.chunk_times_s) == 5 and r.prompt_tokens == 3
            assert r.send_s < r.first_token_s <= r.chunk_times_s[-1] <= r.end_s
    ordered = sorted((r for r in online if r.ok), key=lambda r: r.scheduled_s)
    # Open loop: each request (>= 50 ms of streaming) is sent before the previous one (20 ms earlier) ends.
    assert all(b.send_s < a.end_s for a, b in zip(ordered, ordered[1:]))
    # Closed loop: never more than 2 offline requests outstanding; none sent after the run ended.
    assert offline and all(r.scheduled_s is None for r in offline)
    for r in offline:
        outstanding = sum(1 for o in offline if o.send_s <= r.send_s < o.end_s)
        assert outstanding <= 2
        assert r.send_s <= result.duration_s
    last_online_end = max(r.end_s for r in online)
    assert last_online_end <= result.duration_s <= last_online_end + 0.5
    cut = [r for r in offline if r.cancelled]
    assert 1 <= len(cut) <= 2 and all(r.end_s >= result.duration_s for r in cut)
    assert not result.backlog_exhausted
    assert result.samples and all("fake:num_requests_running" in s for _, s in result.samples)
    assert max(s["fake:num_requests_running"] for _, s in result.samples) >= 1
    deadline = time.monotonic() + 5
    while server.disconnects < len(cut) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.disconnects >= len(cut)  # cancelled offline streams were closed on the server

    m = compute_metrics(result.records, duration_s=result.duration_s)
    assert m.online.completed == 7 and m.online.failed == 1 and m.online.output_tokens == 35
    assert m.send_lag_ms.count == 8


def test_no_sampling_reads_no_metrics(server):
    # A run measuring the server's own cost must not make it render /metrics meanwhile.
    reads = server.metrics_reads
    result = asyncio.run(_run(server, Workload(_online(3, 0.02, 30)), sample_interval_s=None))
    assert all(r.ok for r in result.records) and result.samples == []
    assert server.metrics_reads == reads
    with pytest.raises(WorkloadError, match="sample_interval_s"):
        asyncio.run(_run(server, Workload(_online(1, 0.0, 1)), sample_interval_s=0.0))


def test_drain_offline_lets_running_offline_requests_finish(server):
    wl = Workload(_online(2, 0.02, 3), (_backlog(3, 2, 30),))
    result = asyncio.run(_run(server, wl, drain_offline=True))
    offline = [r for r in result.records if r.request_class is RequestClass.OFFLINE]
    # Two were running when the online side ended (~80 ms, vs >= 300 ms each): finished, no third sent.
    assert len(offline) == 2
    assert all(r.ok and not r.cancelled and r.output_tokens == 30 and r.end_s > result.duration_s for r in offline)


def test_offline_only_runs_for_duration_and_reports_exhaustion(server):
    wl = Workload((), (_backlog(4, 4, 2),), duration_s=0.4)
    result = asyncio.run(_run(server, wl))
    assert len(result.records) == 4 and all(r.ok for r in result.records)
    assert result.backlog_exhausted
    assert result.duration_s >= 0.4


def test_rejects_non_targets():
    with pytest.raises(WorkloadError, match="not a benchmark Target"):
        asyncio.run(run_workload(object(), Workload(_online(1, 0.1, 1)), progress=False))


def test_max_duration_cancels_what_is_still_running_and_says_so(server):
    # 5 requests of 200 tokens at 10 ms a token (2 s each), the last sent at 0.82 s; cut at 0.5 s
    wl = Workload(_online(5, 0.2, 200), ())
    started = time.monotonic()
    result = asyncio.run(_run(server, wl, max_duration_s=0.5))
    assert time.monotonic() - started < 1.5
    assert result.cut_short
    assert 1 <= len(result.records) < 5                         # those sent before the cut only
    assert all(r.cancelled and r.end_s is not None for r in result.records)
    whole = asyncio.run(_run(server, Workload(_online(2, 0.02, 3), ()), max_duration_s=30))
    assert not whole.cut_short and all(r.ok for r in whole.records)
    with pytest.raises(WorkloadError):
        asyncio.run(_run(server, wl, max_duration_s=0))


def test_the_progress_bar_is_redrawn_while_no_request_finishes(server, monkeypatch, capsys):
    """One online request streaming for about a second: the bar's line is redrawn meanwhile (its
    elapsed time), so a user never watches a frozen bar (issue #58: output at least every 10 s)."""
    import backfill.bench.driver as driver

    monkeypatch.setattr(driver, "PROGRESS_EVERY_S", 0.1)
    workload = Workload((BenchRequest("slow", 0.0, "online", (1, 2, 3), "a b c", 100),), ())

    async def go():
        target = HttpTarget(server.base_url, "m")
        try:
            return await run_workload(target, workload, progress=True)
        finally:
            await target.aclose()

    result = asyncio.run(go())
    assert result.records[0].ok and result.records[0].output_tokens == 100
    drawn = capsys.readouterr().err.count("\r")
    assert drawn >= 5, drawn   # tqdm draws at start and end only, without the redraws
