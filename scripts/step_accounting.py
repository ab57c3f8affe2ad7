"""Where each policy's engine time goes: steps grouped by plan mode, forward pass vs whole step.

Runs the co-serving scenario (online trace plus offline backlog) once per policy, back to back,
and prints for each step mode: steps, busy seconds, forward seconds, scheduler overhead per step,
and the offline tokens fed per second of forward pass (aborted steps listed apart). Then the
median forward pass of steps with only online decodes, by how many: the same online work in
online-only and in co-serving mode, to tell a slower policy from slower steps.

    .venv/bin/python scripts/step_accounting.py [--duration 80] [--ttft-slo-ms 215 --tpot-slo-ms 30]
                                                [--policies online-only coserve] [--compile-decode]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections import defaultdict
from dataclasses import replace

from backfill.bench.coserve_bench import _run_round, load_and_profile, make_workload
from backfill.bench.scenario import CoserveScenario
from backfill.types import SLO
from backfill.policy.config import CoServeConfig
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_scheduler
from backfill.serving.async_engine import AsyncEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=80.0)
    parser.add_argument("--ttft-slo-ms", type=float, default=215.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=30.0)
    parser.add_argument("--policies", nargs="+", default=["priority", "coserve"])
    parser.add_argument("--compile-decode", action="store_true")
    args = parser.parse_args()
    serving = ServingConfig(dtype="bfloat16", kv_cache_gb=0.5, compile_decode=args.compile_decode,
                            coserve=CoServeConfig(slo=SLO(args.ttft_slo_ms, args.tpot_slo_ms)))
    loaded, runner, latency = load_and_profile(serving)
    for policy in args.policies:
        workload = make_workload(CoserveScenario(duration_s=args.duration), loaded.tokenizer, latency,
                                 with_offline=policy != "online-only")
        scheduler = build_scheduler(runner, replace(serving, policy=policy), loaded.tokenizer, loaded.config.name,
                                    latency)
        result = asyncio.run(_run_round(AsyncEngine(scheduler, loaded.tokenizer), workload, progress=False))
        groups: dict[tuple[str, bool], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
        for step in scheduler.stats.step_log:
            g = groups[(step.mode, step.aborted)]
            g[0] += 1
            g[1] += step.busy_ms / 1e3
            g[2] += step.forward_ms / 1e3
            g[3] += step.offline_tokens
        made = scheduler.stats.output_tokens["offline"] / result.run.duration_s
        print(f"{policy}: {made:.1f} offline output tok/s over {result.run.duration_s:.0f} s")
        for (mode, aborted), (steps, busy_s, forward_s, fed) in sorted(groups.items()):
            label = f"{mode}{' (aborted)' if aborted else ''}"
            print(f"  {label:<28} {steps:>5} steps  busy {busy_s:6.1f} s  forward {forward_s:6.1f} s  "
                  f"overhead {(busy_s - forward_s) / steps * 1e3:5.1f} ms/step  "
                  f"offline tokens fed {fed:>6} ({fed / max(forward_s, 1e-9):5.0f} per forward s)")
        decodes: dict[int, list[float]] = defaultdict(list)
        between: dict[int, list[float]] = defaultdict(list)
        log = list(scheduler.stats.step_log)
        for step, after in zip(log, log[1:] + [None]):
            if not step.aborted and step.offline_tokens == 0 and step.online_tokens <= 4:
                decodes[step.online_tokens].append(step.forward_ms)
                if after is not None and after.offline_tokens == 0 and after.online_tokens > 0:
                    # From the end of this step to the start of the next: the engine loop, event
                    # delivery and anything else that holds the interpreter between two steps.
                    between[step.online_tokens].append((after.at_s - step.at_s) * 1e3 - step.busy_ms)
        print("  online-only steps, forward ms (median of n): " + ", ".join(
            f"{k} tokens {statistics.median(v):.1f} (n={len(v)})" for k, v in sorted(decodes.items())))
        print("  then until the next online step starts, ms (median / p90): " + ", ".join(
            f"{k} tokens {statistics.median(v):.2f} / {statistics.quantiles(v, n=10)[-1]:.2f}"
            for k, v in sorted(between.items()) if len(v) >= 2))


if __name__ == "__main__":
    main()
