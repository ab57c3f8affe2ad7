"""Prompt steps with the prompt-attention kernel against SDPA per chunk, in turns (docs/peers.md).

    python scripts/prompt_attention_ab.py [--prompts 1 4] [--pairs 12] [--json FILE]

One engine (bf16, compiled decode, the default model), warm; a step of N new 128-token prompts,
timed through the scheduler, with the kernel and with SDPA in ABBA order; medians per arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    from backfill.engine.weights import load_model
    from backfill.policy.planner import BatchLimits
    from backfill.sampling_params import SamplingParams
    from backfill.serving.build import build_runner, build_scheduler
    from backfill.serving.config import ServingConfig
    from backfill.types import GenerationRequest, RequestClass

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = ServingConfig(dtype="bfloat16", compile_decode=True)
    loaded = load_model(cfg.model)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    runner.wait_until_warm()
    kernel = runner.model.paged_prompt_attention
    assert kernel is not None, "the prompt-attention kernel did not build"
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results, seed = {}, 0
    for count in args.prompts:
        limits = BatchLimits(max_batch_tokens=128 * count, max_batch_seqs=64, prefill_chunk_tokens=128)
        scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=300, limits=limits))
        times = {"kernel": [], "sdpa": []}
        for pair in range(args.pairs + 1):  # the first pair warms up, unmeasured
            for arm in (("kernel", "sdpa") if pair % 2 else ("sdpa", "kernel")):
                runner.model.paged_prompt_attention = kernel if arm == "kernel" else None
                for _ in range(count):
                    seed += 1
                    prompt = [100 + (seed * 7919 + i * 104729) % (runner.config.vocab_size - 200) for i in range(128)]
                    scheduler.add(GenerationRequest(prompt, params, RequestClass.ONLINE))
                start = time.perf_counter()
                scheduler.step()
                if pair:
                    times[arm].append((time.perf_counter() - start) * 1e3)
                while scheduler.seqs:
                    scheduler.step()
        medians = {arm: statistics.median(v) for arm, v in times.items()}
        results[count] = {"step_ms": times, "median_ms": medians}
        print(f"{count} x 128-token prompts: kernel {medians['kernel']:.1f} ms, SDPA {medians['sdpa']:.1f} ms "
              f"(medians of {args.pairs}; {medians['kernel'] / medians['sdpa']:.3f}x)")
    runner.model.paged_prompt_attention = kernel
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
