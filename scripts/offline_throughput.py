"""Steady-state offline throughput per policy with no online traffic at all.

Keeps a closed loop of offline requests (the co-serving scenario's backlog: 48 at a time,
prompts of 128-384 tokens, 64-192 new tokens) in the scheduler for a fixed time per policy and
prints offline output tokens/s. It separates how efficiently a policy batches offline work from
how much time the online traffic leaves it: `coserve` runs offline batching mode here, whose
steps are capped so the stretch between two safepoints meets --preempt-target-ms.

It also prints how long the backlog took to start: the time until a step first decoded every
request (all prompts prefilled), which the bench pays at the start of each round.

    .venv/bin/python scripts/offline_throughput.py [--seconds 60] [--preempt-target-ms 7 14 28]
                                                   [--rounds 2] [--compile-decode]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from backfill.bench.coserve_bench import _drain, load_and_profile
from backfill.sampling_params import SamplingParams
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured time per policy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--preempt-target-ms", type=float, nargs="+", default=[10.0])
    parser.add_argument("--rounds", type=int, default=1, help="run the policies in turn this many times")
    parser.add_argument("--compile-decode", action="store_true")
    args = parser.parse_args()
    serving = ServingConfig(dtype=args.dtype, kv_cache_gb=0.5, compile_decode=args.compile_decode)
    loaded, runner, latency = load_and_profile(serving)
    vocab = runner.config.vocab_size
    configs = [("priority", replace(serving, policy="priority"))] + [
        (f"coserve, preempt target {t:g} ms",
         replace(serving, policy="coserve", coserve=replace(serving.coserve, preempt_target_ms=t)))
        for t in args.preempt_target_ms]
    for name, cfg in configs * args.rounds:
        rng = random.Random(0)  # the same request stream for every policy
        scheduler = build_scheduler(runner, cfg, loaded.tokenizer, loaded.config.name, latency)
        sent = 0

        def send() -> None:
            nonlocal sent
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(128, 384))]
            params = SamplingParams(max_tokens=rng.randint(64, 192), temperature=0.0, ignore_eos=True)
            scheduler.add(GenerationRequest(prompt, params, RequestClass.OFFLINE, request_id=f"off-{sent}"))
            sent += 1

        for _ in range(args.concurrency):
            send()
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            finished = sum(event.finished for event in scheduler.step())
            steps += 1
            for _ in range(finished):
                send()
        elapsed_s = time.perf_counter() - start
        made = scheduler.stats.output_tokens["offline"]
        all_decoding = next((r.at_s for r in scheduler.stats.step_log if r.offline_tokens == args.concurrency), None)
        started = "-" if all_decoding is None else f"{all_decoding - scheduler.stats.step_log[0].at_s:.1f} s"
        _drain(scheduler)
        print(f"{name:32s} {made / elapsed_s:6.1f} offline output tok/s  "
              f"({steps} steps, {elapsed_s / steps * 1e3:.0f} ms per step; all decoding after {started})", flush=True)


if __name__ == "__main__":
    main()
