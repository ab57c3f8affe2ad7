from backfill.bench.overload_bench import OverloadOutcome, format_report, summarize, verdicts


def _result(after_ttfts_s: list[float], burst_ttfts_s: list[float], shed: int) -> dict:
    outcomes = [OverloadOutcome("after", float(k), 200, ttft_s=t, e2e_s=t + 1) for k, t in enumerate(after_ttfts_s)]
    outcomes += [OverloadOutcome("burst", float(k), 200, ttft_s=t, e2e_s=t + 1) for k, t in enumerate(burst_ttfts_s)]
    outcomes += [OverloadOutcome("burst", 0.0, 429, retry_after="2") for _ in range(shed)]
    phases = {name: summarize(outcomes, name, 1000.0) for name in ("before", "burst", "after")}
    result = {"sustainable_rps": 1.2345678, "multiplier": 10.0, "burst_s": 60.0, "calm_s": 20.0,
              "ttft_slo_ms": 1000.0, "phases": phases}
    result["verdicts"] = [v.as_dict() for v in verdicts(result)]
    return result


def test_the_admitted_p99_against_the_slo_gets_a_verdict_and_a_rounded_ratio():
    result = _result(after_ttfts_s=[0.5] * 29 + [1.11], burst_ttfts_s=[1.5] * 30, shed=6)
    by_name = {v["quantity"]: v for v in result["verdicts"]}
    assert by_name["after the burst: admitted P99 TTFT / SLO"]["met"] is False      # 1.11x the SLO
    assert by_name["burst: admitted P99 TTFT / SLO"]["met"] is True                 # 1.5x, within 2x
    assert by_name["share of 429s with Retry-After"]["met"] is True
    text = format_report(result)
    assert "1.11x the SLO" in text and "1.1100000" not in text
    assert "missed 1 (after the burst: admitted P99 TTFT / SLO 1.11 against the target <= 1, n=30)" in text


def test_a_p99_on_too_few_requests_says_so_and_is_not_judged():
    result = _result(after_ttfts_s=[0.5] * 19, burst_ttfts_s=[0.5] * 23, shed=0)
    by_name = {v["quantity"]: v for v in result["verdicts"]}
    assert by_name["after the burst: admitted P99 TTFT / SLO"]["met"] is None
    assert by_name["share of 429s with Retry-After"]["met"] is None                 # no 429 at all
    text = format_report(result)
    assert "[P99 from 19 requests: fewer than 20, close to their maximum]" in text
    assert "n/a (too few samples: 19)" in text and "could not judge 2" in text


def test_the_calibration_counts_requests_that_end_after_its_window_and_refuses_none(monkeypatch):
    import asyncio

    import pytest

    from backfill.bench import overload_bench
    from backfill.errors import WorkloadError

    async def slow(client, phase, index, max_tokens, t0, counts=None, status=200):
        await asyncio.sleep(0.2)                  # longer than the 0.05 s window
        return OverloadOutcome(phase, 0.0, status, ttft_s=0.1, e2e_s=0.2)

    monkeypatch.setattr(overload_bench, "_request", slow)
    rate = asyncio.run(overload_bench._closed_loop(None, 2, 0.05, 16))
    assert 5.0 < rate < 12.0                      # 2 requests over about 0.2 s, not 0

    async def refused(*args, **kwargs):
        return OverloadOutcome("calibrate", 0.0, 503)

    monkeypatch.setattr(overload_bench, "_request", refused)
    with pytest.raises(WorkloadError):
        asyncio.run(overload_bench._closed_loop(None, 2, 0.05, 16))
