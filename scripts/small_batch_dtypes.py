"""The small-batch kernel on fp32 rows against bf16 weights and against fp32 weights, in turns.

A bf16 model on a CPU without bf16 matmul kernels computes in fp32 but keeps its weights' bf16
values, which the compiled steps' small-batch kernel reads at two bytes (engine/small_batch_matmul.py).
This times one pass over the default model's shapes (30 layers of q/k/v, o, gate/up and down, then
the LM head) through the kernel at each row count, the two weight dtypes alternating, and prints
the medians and the median ratio of each pair. Random weights; about a minute.

    python scripts/small_batch_dtypes.py --rows 1 8 16 64 --json dtypes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from backfill.engine.small_batch_matmul import (kernel_isa, load_small_batch_matmul, pack_for_small_batches,
                                                packed_matmul)

# The default model's (SmolLM2-135M) matmul shapes, (out, in), and how many of each a step reads.
SHAPES = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30),
          "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}
DTYPES = (torch.float32, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128])
    parser.add_argument("--pairs", type=int, default=9, help="timed turns of each dtype per row count")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not load_small_batch_matmul():
        raise SystemExit("the small-batch kernel does not build on this CPU")
    print(f"timing {len(args.rows)} row counts, {args.pairs} pairs each (about a minute; a line per row count)",
          flush=True)
    g = torch.Generator().manual_seed(0)
    weights = {dtype: {name: [pack_for_small_batches(torch.randn(*shape, generator=g).to(dtype)) for _ in range(n)]
                       for name, (shape, n) in SHAPES.items()} for dtype in DTYPES}
    figures = []
    for rows in args.rows:
        x = {name: torch.randn(rows, shape[1], generator=g) for name, (shape, _) in SHAPES.items()}

        def step_ms(dtype: torch.dtype) -> float:
            start = time.perf_counter()
            for name, ((out_features, _), _) in SHAPES.items():
                for packed in weights[dtype][name]:
                    packed_matmul(packed, x[name], out_features)
            return (time.perf_counter() - start) * 1e3

        for dtype in DTYPES:  # warm
            step_ms(dtype)
        times = {dtype: [] for dtype in DTYPES}
        for _ in range(args.pairs):
            for dtype in DTYPES:
                times[dtype].append(step_ms(dtype))
        ratio = statistics.median(b / f for f, b in zip(times[torch.float32], times[torch.bfloat16]))
        row = {"rows": rows, "fp32_weights_ms": statistics.median(times[torch.float32]),
               "bf16_weights_ms": statistics.median(times[torch.bfloat16]), "bf16_over_fp32": ratio}
        figures.append(row)
        print(f"{rows:4d} rows: fp32 weights {row['fp32_weights_ms']:7.1f} ms, bf16 weights "
              f"{row['bf16_weights_ms']:7.1f} ms, ratio {ratio:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "kernel_isa": kernel_isa(), "threads": torch.get_num_threads(),
                       "machine": platform.machine()}, f, indent=1)


if __name__ == "__main__":
    main()
