import asyncio
import os

import pytest
from bench_helpers import BPETokenizer, FakeOpenAIServer

from backfill.bench.concurrency_burst import BurstShape, level_result, process_cpu_s, run_bursts
from backfill.bench.http_target import HttpTarget
from backfill.bench.metrics import RequestRecord
from backfill.errors import WorkloadError


def _record(send_s: float, first_s: float, end_s: float, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord("r", "online", send_s=send_s, first_token_s=first_s, end_s=end_s, output_tokens=tokens,
                         error=error)


def test_level_result_pools_bursts_by_their_wall_time():
    bursts = [[_record(0.0, 0.1, 1.0, 10), _record(0.0, 0.3, 2.0, 10)],
              [_record(5.0, 5.2, 6.0, 10), _record(5.0, 5.0, 6.0, 0, error="HTTP 500")]]
    r = level_result(2, bursts)
    assert r.requests == 4 and r.failed == 1 and r.output_tokens == 30
    assert r.wall_s == pytest.approx(3.0) and r.tokens_per_s == pytest.approx(10.0)
    assert r.mean_ttft_ms == pytest.approx(200.0)
    assert r.p50_tpot_ms == pytest.approx(900 / 9)


def test_bursts_reach_the_server_all_at_once():
    with FakeOpenAIServer(pace_s=0.01) as server:
        async def go():
            async with HttpTarget(server.base_url, "m", prompt_as="token_ids") as target:
                return await run_bursts(target, BPETokenizer(), (1, 4), BurstShape(16, 5, bursts=2, warmup_tokens=5,
                                                                                   warmup_requests=2),
                                        log=lambda *a: None)
        results = asyncio.run(go())
    assert [r.concurrency for r in results] == [1, 4]
    assert [r.output_tokens for r in results] == [10, 40] and all(r.failed == 0 for r in results)
    assert server.max_running == 4 and len(server.bodies) == 2 + 2 + 8
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] and len(b["prompt"]) == 16 for b in server.bodies)
    # 5 tokens 10 ms apart: a burst lasts at least 50 ms, so no level exceeds 4 x 5 / 0.05 tok/s.
    assert 0 < results[1].tokens_per_s <= 400 and results[1].p50_tpot_ms >= 9


def test_a_long_level_says_it_is_still_running():
    lines = []
    with FakeOpenAIServer(pace_s=0.03) as server:
        async def go():
            async with HttpTarget(server.base_url, "m", prompt_as="token_ids") as target:
                return await run_bursts(target, BPETokenizer(), (2,), BurstShape(16, 10, bursts=2, warmup_requests=0),
                                        log=lines.append, progress_every_s=0.1)
        asyncio.run(go())
    beats = [line for line in lines if line.startswith("   ... concurrency 2:")]
    assert beats and "bursts done" in beats[-1]
    assert lines[-1].startswith("concurrency   2:")  # the level's result closes it


def test_bad_shapes_and_levels():
    with pytest.raises(WorkloadError):
        BurstShape(prompt_tokens=0)
    with pytest.raises(WorkloadError, match="concurrency"):
        asyncio.run(run_bursts(HttpTarget("http://127.0.0.1:1", "m"), BPETokenizer(), (0,)))


def test_cpu_is_recorded_per_level_for_this_process_and_the_server():
    with FakeOpenAIServer(pace_s=0.002) as server:   # in this process: it stands in for the server's pid
        async def go():
            # 2,400 tokens over at least 0.6 s: enough CPU on the event loop's thread to span several of
            # /proc's 10 ms clock ticks on a loaded machine too (320 tokens in 0.1 s once read 0 ticks).
            async with HttpTarget(server.base_url, "m", prompt_as="token_ids") as target:
                return await run_bursts(target, BPETokenizer(), (8,), BurstShape(16, 300, bursts=1, warmup_requests=0),
                                        log=lambda *a: None, server_pid=os.getpid())
        (result,) = asyncio.run(go())
    assert 0 < result.loop_cpu_s <= result.cpu_s + 0.02
    assert 0 < result.server_loop_cpu_s <= result.server_cpu_s + 0.02
    # The fake server's thread is part of this process: its CPU shows in the whole-process figure.
    assert result.server_cpu_s >= result.server_loop_cpu_s


def test_cpu_of_a_missing_process_is_a_typed_error():
    with pytest.raises(WorkloadError, match="no process"):
        process_cpu_s(2**22 + 12345)
    assert process_cpu_s(os.getpid()) > 0


def test_in_process_runs_what_backfill_serve_runs():
    """--in-process builds `backfill serve`'s defaults (auto dtype, compiled steps on CPU), so its
    figures are the server's minus HTTP; flags still override them."""
    from backfill.bench.concurrency_burst import parse_command
    from backfill.serving.config import COMMAND_DEFAULTS

    _, shape, levels, serving = parse_command(["--in-process", "--concurrency", "1", "8"])
    assert (serving.dtype, serving.compile_decode) == (COMMAND_DEFAULTS["dtype"], COMMAND_DEFAULTS["compile_decode"])
    assert levels == (1, 8) and shape.bursts == BurstShape.bursts
    _, _, _, eager = parse_command(["--in-process", "--dtype", "float32", "--no-compile-decode"])
    assert (eager.dtype, eager.compile_decode) == ("float32", False)
