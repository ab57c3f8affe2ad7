"""`backfill bench overload`: a burst of 10x the sustainable online rate against `backfill serve`.

The server runs as a subprocess on a free 127.0.0.1 port with TTFT admission on and no queue-length
limit. First the sustainable rate is measured (a closed loop of a few clients: the requests per
second the server completes), unless given. Then open-loop Poisson arrivals of streamed chat
requests: a calm phase at half that rate, the burst at `multiplier` times it, and a calm phase
again. Reported per phase: admitted requests and their TTFT (P50 / P99 against the SLO), 429s and
how many carried Retry-After. Targets: admitted P99 TTFT in the burst within 2x the SLO; after
the burst, P99 TTFT back within the SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from backfill.bench.server_process import served

TOPICS = ("the history of tea", "how bridges carry load", "why the sky is blue", "the rules of chess",
          "how vaccines work", "the water cycle", "what a compiler does", "the life of bees")


@dataclass
class Outcome:
    phase: str
    sent_s: float
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    retry_after: str | None = None


def _body(index: int, max_tokens: int) -> dict:
    topic = TOPICS[index % len(TOPICS)]
    detail = " Be thorough and give examples." * (1 + index % 4)
    return {"messages": [{"role": "user", "content": f"Explain {topic}.{detail}"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _request(client: httpx.AsyncClient, phase: str, index: int, max_tokens: int, t0: float) -> Outcome:
    sent = time.monotonic()
    outcome = Outcome(phase, sent - t0, 0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=_body(index, max_tokens)) as response:
            outcome.status = response.status_code
            outcome.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                await response.aread()
                return outcome
            async for line in response.aiter_lines():
                if outcome.ttft_s is None and line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                        and '"content":""' not in line.replace(" ", ""):
                    outcome.ttft_s = time.monotonic() - sent
            outcome.e2e_s = time.monotonic() - sent
    except httpx.HTTPError:
        outcome.status = -1
    return outcome


async def _closed_loop(client: httpx.AsyncClient, clients: int, duration_s: float, max_tokens: int) -> float:
    """Requests per second the server completes with `clients` back-to-back clients."""
    done = 0
    deadline = time.monotonic() + duration_s

    async def worker(worker_index: int) -> None:
        nonlocal done
        index = worker_index
        while time.monotonic() < deadline:
            outcome = await _request(client, "calibrate", index, max_tokens, 0.0)
            if outcome.status == 200 and time.monotonic() <= deadline:
                done += 1
            index += clients

    started = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return done / (time.monotonic() - started)


async def _open_loop(client: httpx.AsyncClient, phases: list[tuple[str, float, float]], max_tokens: int,
                     seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    at = 0.0
    index = 0
    for name, rate_rps, duration_s in phases:
        end = at + duration_s
        while True:
            at += rng.expovariate(rate_rps)
            if at >= end:
                at = end
                break
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_request(client, name, index, max_tokens, t0)))
            index += 1
    return list(await asyncio.gather(*tasks))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[Outcome], phase: str, ttft_slo_ms: float) -> dict:
    mine = [o for o in outcomes if o.phase == phase]
    admitted = [o for o in mine if o.status == 200 and o.ttft_s is not None]
    shed = [o for o in mine if o.status == 429]
    ttfts = [o.ttft_s * 1e3 for o in admitted]
    p99 = _percentile(ttfts, 0.99)
    return {"requests": len(mine), "admitted": len(admitted), "rejected_429": len(shed),
            "rejected_with_retry_after": sum(1 for o in shed if o.retry_after),
            "retry_after_s_median": statistics.median(float(o.retry_after) for o in shed if o.retry_after)
            if any(o.retry_after for o in shed) else None,
            "other_errors": len(mine) - len(admitted) - len(shed),
            "ttft_ms_p50": _percentile(ttfts, 0.5), "ttft_ms_p99": p99,
            "ttft_p99_over_slo": p99 / ttft_slo_ms if p99 is not None else None}


def run_overload_bench(*, dtype: str = "bfloat16", kv_cache_gb: float = 0.5, ttft_slo_ms: float = 1000.0,
                       tpot_slo_ms: float = 100.0, multiplier: float = 10.0, burst_s: float = 60.0,
                       calm_s: float = 20.0, sustainable_rps: float | None = None, max_tokens: int = 32,
                       calibrate_s: float = 20.0, calibrate_clients: int = 4, seed: int = 0,
                       extra_server_args: tuple[str, ...] = (), json_path: str | Path | None = None) -> dict:
    server_args = ["--policy", "coserve", "--dtype", dtype, "--kv-cache-gb", str(kv_cache_gb),
                   "--ttft-slo-ms", str(ttft_slo_ms), "--tpot-slo-ms", str(tpot_slo_ms),
                   "--max-online-queue", "100000", "--log-level", "warning", *extra_server_args]
    with served(server_args, health_timeout_s=900.0) as url:
        result = asyncio.run(_drive(url, ttft_slo_ms, multiplier, burst_s, calm_s, sustainable_rps, max_tokens,
                                    calibrate_s, calibrate_clients, seed))
    result.update(dtype=dtype, kv_cache_gb=kv_cache_gb, tpot_slo_ms=tpot_slo_ms, max_tokens=max_tokens,
                  server_args=list(extra_server_args))
    burst, after = result["phases"]["burst"], result["phases"]["after"]
    print(f"sustainable rate {result['sustainable_rps']:.2f} req/s; burst at {multiplier:g}x for {burst_s:g} s")
    for name, phase in result["phases"].items():
        p50 = f"{phase['ttft_ms_p50']:.0f}" if phase["ttft_ms_p50"] is not None else "-"
        p99 = f"{phase['ttft_ms_p99']:.0f}" if phase["ttft_ms_p99"] is not None else "-"
        print(f"  {name:6s}: {phase['requests']:5d} sent, {phase['admitted']:5d} admitted (TTFT P50 {p50} ms, "
              f"P99 {p99} ms, SLO {ttft_slo_ms:g}), {phase['rejected_429']} got 429 "
              f"({phase['rejected_with_retry_after']} with Retry-After), {phase['other_errors']} other errors")
    print(f"burst: admitted P99 TTFT / SLO = {burst['ttft_p99_over_slo']}; after: P99 / SLO = "
          f"{after['ttft_p99_over_slo']}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


async def _drive(url: str, ttft_slo_ms: float, multiplier: float, burst_s: float, calm_s: float,
                 sustainable_rps: float | None, max_tokens: int, calibrate_s: float, calibrate_clients: int,
                 seed: int) -> dict:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0, connect=60.0)) as client:
        await _request(client, "warmup", 0, max_tokens, 0.0)
        if sustainable_rps is None:
            sustainable_rps = await _closed_loop(client, calibrate_clients, calibrate_s, max_tokens)
            await asyncio.sleep(2.0)
        phases = [("before", sustainable_rps / 2, calm_s), ("burst", sustainable_rps * multiplier, burst_s),
                  ("after", sustainable_rps / 2, calm_s)]
        outcomes = await _open_loop(client, phases, max_tokens, seed)
        metrics = (await client.get("/metrics")).text
    return {"sustainable_rps": sustainable_rps, "multiplier": multiplier, "burst_s": burst_s, "calm_s": calm_s,
            "ttft_slo_ms": ttft_slo_ms,
            "phases": {name: summarize(outcomes, name, ttft_slo_ms) for name, _, _ in phases},
            "after_by_second": _after_timeline(outcomes),
            "queue_time_metric": [line for line in metrics.splitlines()
                                  if line.startswith("backfill_request_queue_time_seconds_count")],
            "outcomes": [asdict(o) for o in outcomes]}


def _after_timeline(outcomes: list[Outcome]) -> list[dict]:
    """TTFT of admitted requests in the after phase, by 5 s window since it began."""
    after = [o for o in outcomes if o.phase == "after" and o.ttft_s is not None]
    if not after:
        return []
    start = min(o.sent_s for o in after)
    windows: dict[int, list[float]] = {}
    for o in after:
        windows.setdefault(int((o.sent_s - start) // 5), []).append(o.ttft_s * 1e3)
    return [{"from_s": k * 5, "requests": len(v), "ttft_ms_max": max(v), "ttft_ms_p50": _percentile(v, 0.5)}
            for k, v in sorted(windows.items())]
