"""`backfill bench overload`: a burst of 10x the sustainable online rate against `backfill serve`.

The server runs as a subprocess on a free 127.0.0.1 port with TTFT admission on and no queue-length
limit. First the sustainable rate is measured (a closed loop of a few clients: the requests per
second the server completes), unless given. Then open-loop Poisson arrivals of streamed chat
requests: a calm phase at half that rate, the burst at `multiplier` times it, and a calm phase
again. Reported per phase: admitted requests and their TTFT (P50 / P99 against the SLO), 429s and
how many carried Retry-After. Targets, each a Verdict (bench/verdict.py: n/a below 20 admitted
requests): admitted P99 TTFT in the burst within 2x the SLO; after the burst, P99 TTFT back within
the SLO; every 429 carries Retry-After. It prints its expected duration first and a progress line
at least every PROGRESS_EVERY_S.
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

from backfill.progress import Heartbeat
from backfill.bench.server_process import served, sigterm_as_interrupt
from backfill.bench.verdict import MIN_EVENTS, MIN_SAMPLES_P99, Verdict, closing_sentence, ratio_text
from backfill.errors import WorkloadError

TOPICS = ("the history of tea", "how bridges carry load", "why the sky is blue", "the rules of chess",
          "how vaccines work", "the water cycle", "what a compiler does", "the life of bees")


# Targets (the module's docstring): admitted P99 TTFT over the SLO in the burst and after it.
BURST_P99_OVER_SLO_TARGET = 2.0
AFTER_P99_OVER_SLO_TARGET = 1.0
# What a server start takes before the run's own clock starts (model load and the latency profile
# on a 2-core CPU; a profile measured before is cached): announced as part of the estimate.
SERVER_START_ESTIMATE_S = 60.0
# After the last arrival, requests still running finish: at most a few TTFTs of the SLO.
DRAIN_ESTIMATE_S = 10.0


@dataclass
class Counts:
    """What the load generator has seen so far (its progress line)."""
    phase: str = "warm-up"
    sent: int = 0
    done: int = 0
    rejected: int = 0

    def line(self) -> str:
        return f"{self.phase}: {self.sent} sent, {self.done} finished, {self.rejected} got 429"


@dataclass
class OverloadOutcome:
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


async def _request(client: httpx.AsyncClient, phase: str, index: int, max_tokens: int, t0: float,
                   counts: Counts | None = None) -> OverloadOutcome:
    sent = time.monotonic()
    outcome = OverloadOutcome(phase, sent - t0, 0)
    if counts is not None:
        counts.sent += 1
    try:
        return await _stream(client, outcome, sent, index, max_tokens)
    finally:
        if counts is not None:
            counts.done += 1
            counts.rejected += outcome.status == 429


async def _stream(client: httpx.AsyncClient, outcome: OverloadOutcome, sent: float, index: int, max_tokens: int) -> OverloadOutcome:
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


async def _closed_loop(client: httpx.AsyncClient, clients: int, duration_s: float, max_tokens: int,
                       counts: Counts | None = None) -> float:
    """Requests per second the server completes with `clients` back-to-back clients: every request
    started before `duration_s` is waited for and counted over the time until the last one ends (on
    a slow machine none may end inside a short window)."""
    done = 0
    deadline = time.monotonic() + duration_s

    async def worker(worker_index: int) -> None:
        nonlocal done
        index = worker_index
        while time.monotonic() < deadline:
            outcome = await _request(client, "calibrate", index, max_tokens, 0.0, counts)
            if outcome.status == 200:
                done += 1
            index += clients

    started = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    if done == 0:
        raise WorkloadError(f"the server completed none of its calibration requests in {duration_s:g} s and after: "
                            "give --sustainable-rps, or a quieter machine")
    return done / (time.monotonic() - started)


async def _open_loop(client: httpx.AsyncClient, phases: list[tuple[str, float, float]], max_tokens: int,
                     seed: int, counts: Counts | None = None) -> list[OverloadOutcome]:
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    at = 0.0
    index = 0
    for name, rate_rps, duration_s in phases:
        if counts is not None:
            counts.phase = name
        end = at + duration_s
        while True:
            at += rng.expovariate(rate_rps)
            if at >= end:
                at = end
                break
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_request(client, name, index, max_tokens, t0, counts)))
            index += 1
    if counts is not None:
        counts.phase = "draining"
    return list(await asyncio.gather(*tasks))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[OverloadOutcome], phase: str, ttft_slo_ms: float) -> dict:
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
    load_s = (0.0 if sustainable_rps is not None else calibrate_s) + 2 * calm_s + burst_s + DRAIN_ESTIMATE_S
    print(f"bench overload: about {SERVER_START_ESTIMATE_S + load_s:.0f} s: the server's start (about "
          f"{SERVER_START_ESTIMATE_S:.0f} s, longer the first time it profiles this machine), "
          + ("" if sustainable_rps is not None else f"{calibrate_s:g} s measuring the sustainable rate, ")
          + f"{calm_s:g} s calm, {burst_s:g} s at {multiplier:g}x, {calm_s:g} s calm", flush=True)
    counts = Counts()
    starting = Heartbeat(lambda line: print(line, flush=True), "starting backfill serve (model load, latency profile)")
    with sigterm_as_interrupt(), starting, served(server_args, health_timeout_s=900.0) as url:
        starting.stop()
        print(f"server ready at {url} after {time.monotonic() - starting.started:.0f} s; a warm-up request, then "
              "the load", flush=True)
        with Heartbeat(lambda line: print(line, flush=True), "load", counts.line, expected_s=load_s):
            result = asyncio.run(_drive(url, ttft_slo_ms, multiplier, burst_s, calm_s, sustainable_rps, max_tokens,
                                        calibrate_s, calibrate_clients, seed, counts))
    result.update(dtype=dtype, kv_cache_gb=kv_cache_gb, tpot_slo_ms=tpot_slo_ms, max_tokens=max_tokens,
                  server_args=list(extra_server_args))
    result["verdicts"] = [v.as_dict() for v in verdicts(result)]
    print(format_report(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def verdicts(result: dict) -> list[Verdict]:
    """The run's targets (module docstring), each backed by its sample count."""
    burst, after = result["phases"]["burst"], result["phases"]["after"]
    shed = sum(p["rejected_429"] for p in result["phases"].values())
    with_retry = sum(p["rejected_with_retry_after"] for p in result["phases"].values())
    return [
        Verdict("burst: admitted P99 TTFT / SLO", burst["ttft_p99_over_slo"], BURST_P99_OVER_SLO_TARGET,
                burst["admitted"], MIN_SAMPLES_P99, sample_unit="admitted requests"),
        Verdict("after the burst: admitted P99 TTFT / SLO", after["ttft_p99_over_slo"], AFTER_P99_OVER_SLO_TARGET,
                after["admitted"], MIN_SAMPLES_P99, sample_unit="admitted requests"),
        Verdict("share of 429s with Retry-After", with_retry / shed if shed else None, 1.0, shed, MIN_EVENTS,
                comparison=">=", sample_unit="429s"),
    ]


def format_report(result: dict) -> str:
    """The per-phase table, each target's verdict, and a sentence reading them."""
    slo = result["ttft_slo_ms"]
    rows = [f"sustainable rate {result['sustainable_rps']:.2f} req/s; burst at {result['multiplier']:g}x for "
            f"{result['burst_s']:g} s; TTFT SLO {slo:g} ms"]
    for name, phase in result["phases"].items():
        p50 = f"{phase['ttft_ms_p50']:.0f}" if phase["ttft_ms_p50"] is not None else "-"
        p99 = f"{phase['ttft_ms_p99']:.0f}" if phase["ttft_ms_p99"] is not None else "-"
        note = (f" [P99 from {phase['admitted']} requests: fewer than {MIN_SAMPLES_P99}, close to their maximum]"
                if 0 < phase["admitted"] < MIN_SAMPLES_P99 else "")
        rows.append(f"  {name:6s}: {phase['requests']:5d} sent, {phase['admitted']:5d} admitted (TTFT P50 {p50} ms, "
                    f"P99 {p99} ms = {ratio_text(phase['ttft_p99_over_slo'])} the SLO), {phase['rejected_429']} got "
                    f"429 ({phase['rejected_with_retry_after']} with Retry-After), {phase['other_errors']} other "
                    f"errors{note}")
    judged = [Verdict(**{k: v[k] for k in ("quantity", "value", "target", "samples", "min_samples", "comparison",
                                            "tolerance", "sample_unit")}) for v in result["verdicts"]]
    rows += ["  " + v.describe() for v in judged]
    rows.append(closing_sentence(judged))
    return "\n".join(rows)


async def _drive(url: str, ttft_slo_ms: float, multiplier: float, burst_s: float, calm_s: float,
                 sustainable_rps: float | None, max_tokens: int, calibrate_s: float, calibrate_clients: int,
                 seed: int, counts: Counts | None = None) -> dict:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0, connect=60.0)) as client:
        await _request(client, "warmup", 0, max_tokens, 0.0)
        if sustainable_rps is None:
            if counts is not None:
                counts.phase = "measuring the sustainable rate"
            sustainable_rps = await _closed_loop(client, calibrate_clients, calibrate_s, max_tokens, counts)
            await asyncio.sleep(2.0)
        phases = [("before", sustainable_rps / 2, calm_s), ("burst", sustainable_rps * multiplier, burst_s),
                  ("after", sustainable_rps / 2, calm_s)]
        if counts is not None:
            print(f"sustainable rate {sustainable_rps:.2f} req/s: calm at {sustainable_rps / 2:.2f}/s, burst at "
                  f"{sustainable_rps * multiplier:.2f}/s", flush=True)
            counts.sent = counts.done = counts.rejected = 0
        outcomes = await _open_loop(client, phases, max_tokens, seed, counts)
        metrics = (await client.get("/metrics")).text
    return {"sustainable_rps": sustainable_rps, "multiplier": multiplier, "burst_s": burst_s, "calm_s": calm_s,
            "ttft_slo_ms": ttft_slo_ms,
            "phases": {name: summarize(outcomes, name, ttft_slo_ms) for name, _, _ in phases},
            "after_by_second": _after_timeline(outcomes),
            "queue_time_metric": [line for line in metrics.splitlines()
                                  if line.startswith("backfill_request_queue_time_seconds_count")],
            "outcomes": [asdict(o) for o in outcomes]}


def _after_timeline(outcomes: list[OverloadOutcome]) -> list[dict]:
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
