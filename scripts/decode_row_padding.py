"""Decode steps with the weight matmuls' rows padded to three (the engine's choice) against unpadded, alternating.

oneDNN's bf16 brgemm streams a packed weight at a speed that depends on the row count: per weight
byte, one or two rows run slower than three to six (part 1, the model's matmuls alone, cold in
cache as in a step). Part 2 times whole decode steps of 1-8 sequences on the same model, pool and
sequences, with every Linear padded (`min_rows` 3, engine/linear.py) and unpadded (1), one step of
each setting in turn, so a burst of outside load reaches both alike. Medians; JSON with --json.

    .venv/bin/python scripts/decode_row_padding.py [--reps 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backfill.engine.linear import Linear, MIN_PACKED_BF16_ROWS
from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model
from backfill.serving.build import build_runner
from backfill.serving.config import ServingConfig


def matmul_rows(model, reps: int, rows: list[int]) -> dict[int, float]:
    """ms per step of the model's weight matmuls alone, unpadded, at each row count."""
    linears = [lin for layer in model.layers for lin in layer.values() if isinstance(lin, Linear)] + model.lm_head_slices
    saved = [lin.min_rows for lin in linears]
    for lin in linears:
        lin.min_rows = 1
    inputs = {m: torch.randn(m, 4096, dtype=model.dtype) for m in rows}
    out: dict[int, list[float]] = {m: [] for m in rows}
    try:
        with torch.inference_mode():
            for rep in range(reps + 1):
                for m in rows:
                    start = time.perf_counter()
                    for lin in linears:
                        lin(inputs[m][:, :lin.in_features])
                    if rep:
                        out[m].append((time.perf_counter() - start) * 1e3)
    finally:
        for lin, r in zip(linears, saved):
            lin.min_rows = r
    return {m: statistics.median(v) for m, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    serving = ServingConfig(dtype="auto", kv_cache_gb=2.0)
    loaded = load_model(serving.model)
    runner = build_runner(loaded.config, loaded.weights, serving)
    model, kv = runner.model, runner.kv
    rows = matmul_rows(model, args.reps, [1, 2, 3, 4, 5, 6, 7, 8])
    print("matmuls alone, unpadded (ms per step): " + "  ".join(f"{m} rows {v:.2f}" for m, v in rows.items()))
    linears = [lin for layer in model.layers for lin in layer.values() if isinstance(lin, Linear)] + model.lm_head_slices
    shapes = {(bs, seq): [SeqChunk(f"s{bs}-{seq}-{i}", [5], seq, kv.allocate(kv.blocks_needed(seq + 1)))
                          for i in range(bs)] for bs in args.batches for seq in args.seqlens}
    settings = {"padded": MIN_PACKED_BF16_ROWS, "unpadded": 1}
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {k: [] for k in shapes} for name in settings}
    for rep in range(args.reps + 1):
        for key, chunks in shapes.items():
            for name, min_rows in settings.items():
                for lin in linears:
                    lin.min_rows = min_rows if lin.packed else 1
                start = time.perf_counter()
                runner.execute(chunks)
                if rep:  # the first round warms every shape
                    times[name][key].append((time.perf_counter() - start) * 1e3)
    print(f"decode step ms (median of {args.reps}), {model.matmul_kernel}, {torch.get_num_threads()} threads")
    print("batch x context   unpadded   padded   padded/unpadded")
    steps = []
    for key in shapes:
        u, p = (statistics.median(times[n][key]) for n in ("unpadded", "padded"))
        steps.append({"batch": key[0], "seqlen": key[1], "unpadded_ms": u, "padded_ms": p})
        print(f"{key[0]:5d} x {key[1]:4d}     {u:8.2f} {p:8.2f}   {p / u:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"matmul_rows_ms": rows, "steps": steps, "reps": args.reps,
                                               "kernel": model.matmul_kernel, "threads": torch.get_num_threads()},
                                              indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
