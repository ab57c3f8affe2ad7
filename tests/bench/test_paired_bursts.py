import asyncio
import json
import os

import pytest
from bench_helpers import BPETokenizer, FakeOpenAIServer

from backfill.bench.concurrency_burst import BurstShape, LevelResult
from backfill.bench.http_target import HttpTarget
from backfill.bench.paired_bursts import Pair, main, median_interval, pair_order, run_loop, run_paired, summarize
from backfill.bench.server_process import served
from backfill.errors import WorkloadError


def test_median_interval_takes_the_widest_order_statistics_that_reach_the_level():
    # n = 10: P(Binomial(10, 1/2) < 2) = 11/1024, so [x(2), x(9)] covers 1 - 22/1024 = 97.9%;
    # [x(3), x(8)] would cover only 89.1%.
    r = median_interval([10, 1, 9, 2, 8, 3, 7, 4, 6, 5])
    assert (r.median, r.low, r.high, r.n) == (5.5, 2.0, 9.0, 10)
    assert r.coverage == pytest.approx(1 - 22 / 1024)
    # n = 5 cannot reach 95%: the full range, which covers 1 - 2/32.
    r = median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (r.median, r.low, r.high) == (3.0, 1.0, 5.0) and r.coverage == pytest.approx(0.9375)
    # n = 20 at 95%: k = 6 (P(B < 6) = 0.0207), [x(6), x(15)].
    r = median_interval(range(1, 21))
    assert (r.low, r.high) == (6.0, 15.0) and r.coverage == pytest.approx(0.9586, abs=1e-4)


def test_median_interval_bad_input_is_a_typed_error():
    with pytest.raises(WorkloadError, match="at least one"):
        median_interval([])
    with pytest.raises(WorkloadError, match="NaN"):
        median_interval([1.0, float("nan")])
    with pytest.raises(WorkloadError, match="level"):
        median_interval([1.0, 2.0], level=1.0)


def test_pairs_alternate_which_arm_goes_first():
    assert [pair_order(i) for i in range(4)] == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]


def _level(tok_s: float, tpot_ms: float, tokens: int = 100, loop_cpu_s: float | None = 0.01,
           server_loop_cpu_s: float | None = None) -> LevelResult:
    return LevelResult(1, 1, 0, tokens, tokens / tok_s if tok_s else 1.0, tok_s, 50.0, 50.0, tpot_ms, tpot_ms,
                       cpu_s=0.02, loop_cpu_s=loop_cpu_s, server_loop_cpu_s=server_loop_cpu_s)


def test_summary_is_the_median_of_per_pair_ratios_with_pooled_cpu_per_token():
    # Each pair's ratio, not the ratio of the arms' medians: pairs 90/100, 50/50, 110/100.
    pairs = [Pair("a", _level(90, 11, server_loop_cpu_s=0.02), _level(100, 10, loop_cpu_s=0.005)),
             Pair("b", _level(50, 20, server_loop_cpu_s=0.03), _level(50, 20, loop_cpu_s=0.005)),
             Pair("a", _level(110, 9, server_loop_cpu_s=0.01), _level(100, 10, loop_cpu_s=0.005))]
    row = summarize(1, pairs)
    assert row["tok_s_ratios"] == pytest.approx([0.9, 1.0, 1.1]) and row["tok_s_ratio"] == pytest.approx(1.0)
    assert (row["tok_s_ratio_low"], row["tok_s_ratio_high"]) == pytest.approx((0.9, 1.1))
    assert row["tpot_ratio"] == pytest.approx(1.0) and row["tpot_ratio_high"] == pytest.approx(1.1)
    assert row["throughput_overhead_pct"] == pytest.approx(0.0)
    assert row["throughput_overhead_pct_interval"] == pytest.approx([-10.0, 10.0])
    assert row["tpot_overhead_pct_interval"] == pytest.approx([-10.0, 10.0])
    assert row["interval_coverage"] == pytest.approx(0.75) and row["orders"] == ["ab", "ba", "ab"]
    assert row["a_tok_s"] == 90 and row["b_tok_s"] == 100
    # 0.06 s of the server's loop over 300 tokens: 0.2 ms a token; B's loop 0.015 s: 0.05 ms.
    assert row["a_server_loop_ms_per_token"] == pytest.approx(0.2)
    assert row["b_loop_ms_per_token"] == pytest.approx(0.05)
    assert row["a_server_ms_per_token"] is None   # not measured: no figure, not zero


def test_summary_refuses_a_burst_without_tokens():
    with pytest.raises(WorkloadError, match="no tokens"):
        summarize(8, [Pair("a", _level(0.0, float("nan"), tokens=0), _level(100, 10))])
    with pytest.raises(WorkloadError, match="no pairs"):
        summarize(8, [])


def test_paired_bursts_tell_a_slower_server_from_a_faster_one():
    shape = BurstShape(16, 6, bursts=1, warmup_tokens=2, warmup_requests=1)
    with FakeOpenAIServer(pace_s=0.04) as slow, FakeOpenAIServer(pace_s=0.01) as fast:
        async def go():
            async with HttpTarget(slow.base_url, "m", prompt_as="token_ids") as a, \
                    HttpTarget(fast.base_url, "m", prompt_as="token_ids") as b:
                return await run_paired(a, b, BPETokenizer(), (2,), pairs=2, shape=shape, settle_s=0.0,
                                        a_server_pid=os.getpid(), log=lambda *_: None)
        (row,) = asyncio.run(go())
    # Each arm: one warm-up request, then two bursts of two requests.
    assert len(slow.bodies) == len(fast.bodies) == 1 + 2 * 2
    assert row["pairs"] == 2 and row["orders"] == ["ab", "ba"] and row["failed"] == 0
    # Tokens 40 ms apart against 10 ms apart: A's TPOT is several times B's, its tok/s a fraction.
    assert row["tpot_ratio_low"] > 2.0 and row["tok_s_ratio_high"] < 0.6
    assert row["throughput_overhead_pct"] > 40 and row["a_server_loop_ms_per_token"] is not None


def test_bad_pairs_levels_and_loops_are_typed_errors():
    target = HttpTarget("http://127.0.0.1:1", "m")
    with pytest.raises(WorkloadError, match="pairs"):
        asyncio.run(run_paired(target, target, BPETokenizer(), (1,), pairs=0))
    with pytest.raises(WorkloadError, match="concurrency"):
        asyncio.run(run_paired(target, target, BPETokenizer(), (0,)))

    async def nothing():
        return 1
    with pytest.raises(WorkloadError, match="client_loop"):
        run_loop(nothing(), "trio")
    assert run_loop(nothing(), "asyncio") == (1, "asyncio")


def test_an_http_arm_needs_a_url():
    with pytest.raises(SystemExit):
        main(["--tiny", "--pairs", "1"])


def test_one_pair_against_the_tiny_server_and_its_engine_in_process(tmp_path):
    out = tmp_path / "paired.json"
    with served(["--tiny", "--log-level", "warning"], health_timeout_s=120.0) as url:
        assert main(["--tiny", "--url", url, "--pairs", "1", "--concurrency", "2", "--prompt-tokens", "8",
                     "--output-tokens", "4", "--settle-s", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["levels"]
    assert doc["arms"] == {"a": "http", "b": "in-process"} and doc["client_loop"] in ("uvloop", "asyncio")
    assert row["concurrency"] == 2 and row["pairs"] == 1 and row["failed"] == 0
    assert row["bursts"][0]["a"]["output_tokens"] == row["bursts"][0]["b"]["output_tokens"] == 8
    assert row["tok_s_ratio"] > 0 and row["a_loop_ms_per_token"] is not None
