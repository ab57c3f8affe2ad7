"""Batched decode steps with the boolean padding mask against the additive one, alternating in one process.

The runner builds an additive mask; for the "boolean" steps this script turns it back into the
boolean mask SDPA used to get, so both kinds of step run on the same model, pool and sequences.

    .venv/bin/python scripts/decode_mask_ab.py [--batch 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

from backfill.bench.engine_bench import _limits, _prompt
from backfill.engine import model as model_module
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import load_model
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    loaded = load_model(None)
    # Gather + SDPA: the paged-attention kernel takes no mask at all.
    runner = build_runner(loaded.config, loaded.weights, ServingConfig(dtype=args.dtype, kv_cache_gb=2.0,
                                                                      max_model_len=400, decode_attention="sdpa"))
    scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=400,
                                                      limits=_limits(args.batch, 128)))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        scheduler.add(GenerationRequest(_prompt(128, i, runner.config.vocab_size), params, RequestClass.OFFLINE))
    for _ in range(3):  # prefill and warm-up
        scheduler.step()
    forward = model_module.LlamaModel.forward
    boolean = {"on": False}

    def with_mask_kind(self, input_ids, meta, kv, safepoint=None, resume=None):
        if boolean["on"] and meta.decode_key_mask is not None:
            meta.decode_key_mask = meta.decode_key_mask == 0
        return forward(self, input_ids, meta, kv, safepoint, resume)

    model_module.LlamaModel.forward = with_mask_kind
    times: dict[str, list[float]] = {"boolean mask": [], "additive mask": []}
    for i in range(args.steps):
        boolean["on"] = (i // 3) % 2 == 0
        start = time.perf_counter()
        scheduler.step()
        times["boolean mask" if boolean["on"] else "additive mask"].append(time.perf_counter() - start)
        if not scheduler.has_work():
            break
    for kind, steps in times.items():
        median = statistics.median(steps)
        print(f"batch {args.batch} {args.dtype}, {kind}: {median * 1e3:.1f} ms/step, "
              f"{args.batch / median:.0f} tok/s ({len(steps)} steps)")


if __name__ == "__main__":
    main()
