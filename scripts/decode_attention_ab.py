"""Decode steps with the paged-attention kernel against gather + SDPA, alternating in one process.

Both kinds of step run on the same model, pool and sequences: the script switches the model's
kernel off and on every few steps, so a drifting machine slows both alike.

    .venv/bin/python scripts/decode_attention_ab.py [--dtype float32] [--batch 1] [--prompt-tokens 128]
                                                    [--new-tokens 200] [--compile-decode]
"""

from __future__ import annotations

import argparse
import statistics
import time

from backfill.bench.engine_bench import _limits, _prompt
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import load_model
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--every", type=int, default=3, help="switch after this many steps")
    args = parser.parse_args()
    max_len = args.prompt_tokens + args.new_tokens + 8
    loaded = load_model(None)
    runner = build_runner(loaded.config, loaded.weights, ServingConfig(
        dtype=args.dtype, kv_cache_gb=2.0, max_model_len=max_len, compile_decode=args.compile_decode))
    kernel = runner.model.paged_decode_attention
    if kernel is None:
        raise SystemExit("the paged-attention kernel could not be built here (see the warning above)")
    scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=max_len,
                                                      limits=_limits(args.batch, args.prompt_tokens)))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        # Prompts of different lengths, so that batched steps pad (the SDPA path's cost).
        length = max(1, args.prompt_tokens - 3 * i)
        scheduler.add(GenerationRequest(_prompt(length, i, runner.config.vocab_size), params, RequestClass.OFFLINE))
    while any(s.num_computed < len(s.prompt_ids) for s in scheduler.seqs.values()):
        scheduler.step()
    times: dict[str, list[float]] = {"gather + SDPA": [], "kernel": []}
    step = 0
    while scheduler.has_work():
        use_kernel = (step // args.every) % 2 == 0
        runner.model.paged_decode_attention = kernel if use_kernel else None
        start = time.perf_counter()
        scheduler.step()
        times["kernel" if use_kernel else "gather + SDPA"].append(time.perf_counter() - start)
        step += 1
    for kind, steps in times.items():
        median = statistics.median(steps)
        print(f"{args.dtype} batch {args.batch}, context {args.prompt_tokens}-{args.prompt_tokens + args.new_tokens}"
              f"{' (compiled decode)' if args.compile_decode else ''}, {kind}: {median * 1e3:.2f} ms/step, "
              f"{args.batch / median:.0f} tok/s ({len(steps)} steps)")


if __name__ == "__main__":
    main()
