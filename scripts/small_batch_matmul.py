"""The small-batch matmul kernel against oneDNN and plain F.linear, on a decode step's weights.

Thirty [N x K] weights, as many as the model has layers, so they stream from memory as in a
decode step rather than sitting in cache; medians of alternating rounds, reported as the weight
bytes read per second (engine/small_batch_matmul.py).

    .venv/bin/python scripts/small_batch_matmul.py [--dtype bfloat16] [--n 3072] [--k 576] [--batches 1 2 4 8]
                                                   [--json runs/small-batch-matmul.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backfill.engine.linear import Linear
from backfill.engine.small_batch_matmul import load_small_batch_matmul, pack_for_small_batches, packed_matmul

LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--n", type=int, default=3072, help="output features (3072: gate/up of SmolLM2-135M)")
    parser.add_argument("--k", type=int, default=576, help="input features")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not load_small_batch_matmul():
        raise SystemExit("the small-batch kernel is not available on this CPU (it needs AVX-512 BF16)")
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(args.n, args.k, dtype=dtype) * 0.02 for _ in range(LAYERS)]
    packed = [pack_for_small_batches(w) for w in weights]
    onednn = [Linear(w, packed=True) for w in weights]
    weight_bytes = LAYERS * args.n * args.k * weights[0].element_size()
    result = {"dtype": args.dtype, "n": args.n, "k": args.k, "layers": LAYERS, "batches": {}}
    for m in args.batches:
        x = torch.randn(m, args.k, dtype=dtype)
        paths = {"kernel": lambda: [packed_matmul(p, x, args.n) for p in packed],
                 "onednn": lambda: [lin(x) for lin in onednn],
                 "F.linear": lambda: [F.linear(x, w) for w in weights]}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, run in paths.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        row = {}
        for name, ts in times.items():
            median_s = statistics.median(ts[2:])  # the first rounds warm up
            row[name] = {"ms": median_s * 1e3, "gb_per_s": weight_bytes / median_s / 1e9}
        result["batches"][m] = row
        print(f"M={m}: " + ", ".join(f"{name} {r['ms']:.2f} ms ({r['gb_per_s']:.0f} GB/s)" for name, r in row.items()),
              flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
