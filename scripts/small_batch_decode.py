"""Decode steps, compiled pieces against the eager path, alternating in one process.

One model built with compiled decode; the script hides its compiled pieces every few steps so the
same steps run eager, on the same pool and sequences, and a drifting machine slows both alike.
Batches above eight run in the padded buckets (engine/compiled_decode.py), which the script waits
for before it measures.

    .venv/bin/python scripts/small_batch_decode.py [--dtype bfloat16] [--context 200] [--steps 60]
                                                   [--batches 1 2 4 8]
                                                   [--json runs/small-batch-decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens before the decodes")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per batch size and path")
    parser.add_argument("--every", type=int, default=3, help="switch paths after this many steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    loaded = load_model(None)
    runner = build_runner(loaded.config, loaded.weights, ServingConfig(
        dtype=args.dtype, kv_cache_gb=0.5, max_model_len=args.context + 2 * args.steps + 8, compile_decode=True))
    model, kv = runner.model, runner.kv
    compiled = model.compiled_decode
    if compiled is None:
        raise SystemExit("compiled decode could not be built here (see the warning above)")
    compiled.wait_for_buckets()
    result = {"dtype": args.dtype, "context": args.context, "compiled_batch_sizes": list(compiled.batch_sizes),
              "buckets": sorted(compiled.buckets), "small_batch_kernel": compiled.packed, "batches": {}}
    for batch in args.batches:
        tables = [kv.allocate(kv.blocks_needed(args.context + 2 * args.steps + 1)) for _ in range(batch)]
        for i, table in enumerate(tables):
            runner.execute([SeqChunk(i, [5] * args.context, 0, table, want_logits=False)])
        times = {"compiled": [], "eager": []}
        for step in range(2 * args.steps + 2 * args.every):
            path = "compiled" if (step // args.every) % 2 == 0 else "eager"
            model.compiled_decode = compiled if path == "compiled" else None
            out = runner.execute([SeqChunk(i, [5], args.context + step, t) for i, t in enumerate(tables)])
            if step >= 2 * args.every:  # the first switch of each path warms it up
                times[path].append(out.duration_s * 1e3)
        model.compiled_decode = compiled
        for table in tables:
            kv.free(table)
        row = {path: statistics.median(ms) for path, ms in times.items()}
        row["eager_over_compiled"] = row["eager"] / row["compiled"]
        result["batches"][batch] = row
        print(f"batch {batch}: compiled {row['compiled']:.1f} ms, eager {row['eager']:.1f} ms "
              f"({row['eager_over_compiled']:.2f}x) per step, median of {len(times['compiled'])}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
