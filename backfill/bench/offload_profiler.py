"""AQUA-PROFILER for LLMs (§4, §4.1): is this engine a producer or a consumer of memory?

1. The highest request rate it sustains within its SLA (P99 TTFT and P99 TPOT): a binary
   search over [lo, hi], then linear steps up from the best rate found to a local maximum.
2. The KV memory free at that rate (the most it used while probed, subtracted from its pool):
   what it can offer. Above a threshold it is a producer.
3. The swap space it needs for bursts of 2x, 3x, 5x that rate (AQUA §9.4): CFS with host-memory
   swap under an artificial burst, the most paged-out KV held at once.

Each probe is a short open-loop run of the benchmark harness (backfill/bench) on the real engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from backfill.bench.arrivals import poisson_arrivals, step_arrivals
from backfill.bench.driver import run_workload
from backfill.bench.inprocess_target import InProcessTarget
from backfill.bench.lengths import parse_length_spec
from backfill.bench.metrics import compute_metrics
from backfill.bench.prompts import PromptSource
from backfill.bench.workload import build_workload
from backfill.errors import WorkloadError


MIN_PROBE_REQUESTS = 4


@dataclass(frozen=True)
class Probe:
    rate_per_s: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    meets_sla: bool
    peak_kv_fraction: float     # most of the KV pool in use at once while probed


def find_max_rate(measure: Callable[[float], Probe], lo: float, hi: float, *, binary_steps: int = 3,
                  step: float = 0.5, max_linear_steps: int = 4) -> tuple[Probe | None, list[Probe]]:
    """AQUA §4.1: binary search in [lo, hi] for the highest rate within the SLA, then linear
    steps of `step` up from it (and down, if it fails on a re-probe) to a local maximum."""
    if not 0 < lo < hi or step <= 0 or binary_steps < 0:
        raise WorkloadError(f"need 0 < lo < hi and step > 0, got lo={lo}, hi={hi}, step={step}")
    probes: list[Probe] = []

    def probe(rate: float) -> Probe:
        result = measure(rate)
        probes.append(result)
        return result

    best = probe(lo)
    if not best.meets_sla:
        return None, probes
    low, high = lo, hi
    for _ in range(binary_steps):
        mid = (low + high) / 2
        result = probe(mid)
        if result.meets_sla:
            low, best = mid, result
        else:
            high = mid
    for _ in range(max_linear_steps):
        result = probe(best.rate_per_s + step)
        if not result.meets_sla:
            break
        best = result
    return best, probes


@dataclass(frozen=True)
class ProfileConfig:
    ttft_sla_ms: float = 1000.0         # AQUA §4.1 (after Sarathi-Serve): TTFT under 1 s ...
    tpot_sla_ms: float = 100.0          # ... and 100 ms P99 between tokens
    lo_rate: float = 0.25
    hi_rate: float = 4.0
    binary_steps: int = 3
    linear_step: float = 0.25
    probe_s: float = 10.0               # each rate's open-loop run
    burst_factors: tuple[float, ...] = (2.0, 3.0, 5.0)
    burst_s: float = 15.0               # AQUA: 1-minute bursts; shorter on a 2-core CPU
    prompt_len: str = "uniform:64:192"
    output_len: str = "fixed:64"
    kv_cache_gb: float = 0.25
    producer_threshold_mb: float = 64.0  # free memory above this at the peak rate: a producer
    seed: int = 0
    decode_attention: str = "auto"      # "sdpa": no C++ kernel build (see ServingConfig)
    threads: int | None = None          # torch threads: the burst benchmark's consumer uses 1


@dataclass
class Profile:
    config: ProfileConfig
    max_rate_per_s: float | None
    kv_pool_bytes: int
    free_bytes_at_max_rate: int
    role: str                            # producer | consumer
    swap_bytes_for_burst: dict[str, int] = field(default_factory=dict)   # "2x" -> bytes
    probes: list[Probe] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**asdict(self), "config": asdict(self.config)}


def run_profile(config: ProfileConfig = ProfileConfig(), log=print) -> Profile:
    from backfill.engine.weights import load_model
    from backfill.memory.pager import make_pager
    from backfill.policy.baselines import FCFSPolicy
    from backfill.policy.cfs import CFSPolicy
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_runner
    from backfill.serving.async_engine import AsyncEngine
    from backfill.serving.scheduler import Scheduler
    from backfill.serving.torch_thread import run_on_torch_thread

    loaded = load_model(None)
    runner = run_on_torch_thread(build_runner, loaded.config, loaded.weights,
                                 ServingConfig(policy="fcfs", kv_cache_gb=config.kv_cache_gb, device="cpu",
                                               decode_attention=config.decode_attention, threads=config.threads))
    prompts = PromptSource(loaded.tokenizer, seed=config.seed)
    plen, olen = parse_length_spec(config.prompt_len), parse_length_spec(config.output_len)

    def run(arrivals: np.ndarray, scheduler: Scheduler, name: str):
        workload = build_workload(prompts, arrivals, plen, olen, config.seed, name=name)
        engine = AsyncEngine(scheduler, loaded.tokenizer)

        async def go():
            await engine.start()
            try:
                return await run_workload(InProcessTarget(engine), workload, progress=False, sample_interval_s=0.2)
            finally:
                await engine.stop()

        return asyncio.run(go())

    def measure(rate: float) -> Probe:
        # At least a few requests even at a low rate, or its percentiles mean nothing.
        duration_s = max(config.probe_s, MIN_PROBE_REQUESTS / rate)
        result = run(poisson_arrivals(rate, config.seed, duration_s=duration_s), Scheduler(runner, FCFSPolicy()),
                     f"probe-{rate:g}")
        metrics = compute_metrics(result.records, duration_s=result.duration_s)
        ttft, tpot = metrics.online.ttft_ms.p99 or 0.0, metrics.online.tpot_ms.p99 or 0.0
        peak = max((s.get("kv_usage", 0.0) for _, s in result.samples), default=0.0)
        probe = Probe(rate, ttft, tpot, ttft <= config.ttft_sla_ms and tpot <= config.tpot_sla_ms, peak)
        log(f"  {rate:5.2f} req/s: P99 TTFT {ttft:7.0f} ms, P99 TPOT {tpot:6.1f} ms, peak KV {100 * peak:3.0f}% "
            f"-> {'within' if probe.meets_sla else 'outside'} the SLA")
        return probe

    log(f"== highest rate within P99 TTFT {config.ttft_sla_ms:.0f} ms / TPOT {config.tpot_sla_ms:.0f} ms")
    best, probes = find_max_rate(measure, config.lo_rate, config.hi_rate, binary_steps=config.binary_steps,
                                 step=config.linear_step)
    pool = runner.kv.nbytes
    free = int(pool * (1 - best.peak_kv_fraction)) if best is not None else 0
    role = "producer" if free >= config.producer_threshold_mb * 2**20 else "consumer"
    profile = Profile(config, best.rate_per_s if best else None, pool, free, role, probes=probes)
    if best is None:
        log("no rate within the SLA: a consumer with nothing to offer")
        return profile
    log(f"max rate {best.rate_per_s:.2f} req/s; KV free there {free / 2**20:.0f} of {pool / 2**20:.0f} MB -> {role}")
    for factor in config.burst_factors:
        rate = best.rate_per_s
        arrivals = step_arrivals([(0.0, rate * factor)], max(config.burst_s, MIN_PROBE_REQUESTS / (rate * factor)),
                                 config.seed)
        scheduler = Scheduler(runner, CFSPolicy())
        scheduler.pager = make_pager(runner.kv.device)
        run(arrivals, scheduler, f"burst-{factor:g}x")
        need = scheduler.pager.stats.peak_bytes
        profile.swap_bytes_for_burst[f"{factor:g}x"] = need
        log(f"  {factor:g}x burst ({rate * factor:.2f} req/s for {config.burst_s:.0f} s): swap {need / 2**20:.0f} MB")
    return profile


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    d = ProfileConfig()
    p.add_argument("--ttft-sla-ms", type=float, default=d.ttft_sla_ms)
    p.add_argument("--tpot-sla-ms", type=float, default=d.tpot_sla_ms)
    p.add_argument("--lo-rate", type=float, default=d.lo_rate)
    p.add_argument("--hi-rate", type=float, default=d.hi_rate)
    p.add_argument("--binary-steps", type=int, default=d.binary_steps)
    p.add_argument("--linear-step", type=float, default=d.linear_step)
    p.add_argument("--probe-s", type=float, default=d.probe_s)
    p.add_argument("--burst-factors", type=float, nargs="+", default=list(d.burst_factors))
    p.add_argument("--burst-s", type=float, default=d.burst_s)
    p.add_argument("--prompt-len", default=d.prompt_len)
    p.add_argument("--output-len", default=d.output_len)
    p.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb)
    p.add_argument("--decode-attention", default=d.decode_attention, choices=("auto", "sdpa"))
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (as the burst's --threads)")
    p.add_argument("--json", default="runs/offload-profile.json")


def run_profile_command(args: argparse.Namespace) -> None:
    config = ProfileConfig(args.ttft_sla_ms, args.tpot_sla_ms, args.lo_rate, args.hi_rate, args.binary_steps,
                           args.linear_step, args.probe_s, tuple(args.burst_factors), args.burst_s, args.prompt_len,
                           args.output_len, args.kv_cache_gb, decode_attention=args.decode_attention,
                           threads=args.threads)
    profile = run_profile(config)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(profile.to_json(), indent=1))
    print(f"wrote {args.json}")
