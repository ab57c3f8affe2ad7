"""The paged decode attention kernel inside real decode steps: its share of the step and the
bandwidth it reaches there.

`paged_attention_micro.py` times the kernel on one layer of a small pool, which the caches partly
hold. In a decode step the kernel reads every layer's keys and values from memory, in blocks the
pool handed out in no order. This script decodes BATCH sequences of CONTEXT tokens on the default
model and times each kernel call inside the steps.

    .venv/bin/python scripts/decode_attention_in_step.py [--batch 32] [--contexts 100 600]
                                                         [--dtype bfloat16] [--compile-decode]
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
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 600])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile-decode", action="store_true")
    args = parser.parse_args()
    max_len = max(args.contexts) + args.steps + 16
    loaded = load_model(None)
    runner = build_runner(loaded.config, loaded.weights, ServingConfig(
        dtype=args.dtype, kv_cache_gb=2.0, max_model_len=max_len, compile_decode=args.compile_decode))
    kernel = runner.model.paged_decode_attention
    if kernel is None:
        raise SystemExit("the paged-attention kernel could not be built here (see the warning above)")
    kernel_s = [0.0]

    def timed_kernel(*tensors):
        start = time.perf_counter()
        out = kernel(*tensors)
        kernel_s[0] += time.perf_counter() - start
        return out

    runner.model.paged_decode_attention = timed_kernel
    cfg = runner.config
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.kv.k.element_size()
    for context in args.contexts:
        scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=max_len,
                                                          limits=_limits(args.batch, context)))
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            scheduler.add(GenerationRequest(_prompt(context, i, cfg.vocab_size), params, RequestClass.OFFLINE))
        while any(s.num_computed < len(s.prompt_ids) for s in scheduler.seqs.values()):
            scheduler.step()
        step_s, kernel_s[0] = [], 0.0
        for _ in range(args.steps):
            start = time.perf_counter()
            scheduler.step()
            step_s.append(time.perf_counter() - start)
        per_step_s = kernel_s[0] / args.steps
        read_gbs = args.batch * context * kv_bytes_per_token / per_step_s / 1e9
        print(f"{args.dtype} batch {args.batch} context {context}: {statistics.median(step_s) * 1e3:.2f} ms per step, "
              f"kernel {per_step_s * 1e3:.2f} ms of it, reading {read_gbs:.1f} GB/s", flush=True)
        while scheduler.has_work():
            scheduler.step()


if __name__ == "__main__":
    main()
