"""Where an in-process burst's time goes, by operator (docs/peers.md).

    python scripts/burst_profile_probe.py [--concurrency 64]

One engine as `backfill serve` builds it (bf16, compiled decode, warm), one unmeasured burst, then
one burst of N 128-token prompts with 64 new tokens each (ignore_eos) stepped through the scheduler
under torch.profiler; the two attention kernels (C++ functions outside the profiler's view) are
wrapped in record_function so they show as their own rows.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    from backfill.engine.weights import load_model
    from backfill.sampling_params import SamplingParams
    from backfill.serving.build import build_runner, build_scheduler
    from backfill.serving.config import ServingConfig
    from backfill.types import GenerationRequest, RequestClass

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    cfg = ServingConfig(dtype="bfloat16", compile_decode=True)
    loaded = load_model(cfg.model)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    runner.wait_until_warm()
    model = runner.model
    decode, prompt = model.paged_decode_attention, model.paged_prompt_attention

    def named(name, fn):
        def call(*a):
            with record_function(name):
                return fn(*a)
        return call

    if decode is not None:
        model.paged_decode_attention = named("paged_decode_attention", decode)
    if prompt is not None:
        model.paged_prompt_attention = named("paged_prompt_attention", prompt)
    scheduler = build_scheduler(runner, cfg)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    vocab = loaded.config.vocab_size

    def burst(salt: int) -> tuple[float, int]:
        for i in range(args.concurrency):
            ids = [100 + ((salt * 1000 + i) * 7919 + j * 104729) % (vocab - 200) for j in range(128)]
            scheduler.add(GenerationRequest(ids, params, RequestClass.ONLINE))
        start, steps = time.perf_counter(), 0
        while scheduler.has_work():
            scheduler.step()
            steps += 1
        return time.perf_counter() - start, steps

    burst(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, steps = burst(2)
    print(f"burst of {args.concurrency}: {seconds:.2f} s, {steps} steps, {args.concurrency * 64 / seconds:.1f} tok/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
