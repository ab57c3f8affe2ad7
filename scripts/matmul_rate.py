"""GFLOP/s of the small-batch kernel and of F.linear on the default model's layer shapes, by rows.

Each shape's weight is random (the shape is what matters), multiplied again and again, so it sits
in the cores' caches: this is the arithmetic rate, what a large step's matmuls can reach, not the
rate of a decode step that streams every layer's weights from memory (the kernel choice times that,
engine/kernel_choice.py). Best of seven timings of 30 products each, on the engine's threads, in
the dtype the commands' default resolves to here (float32 on a CPU without bf16 matmul kernels).
About 6 s a row count on two AVX2 cores (half a minute for the default rows); a line every 8 s.

    python scripts/matmul_rate.py --rows 1 8 64 128 512 --json matmul-rate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from backfill.engine.small_batch_matmul import load_small_batch_matmul, pack_for_small_batches, packed_matmul
from backfill.progress import Heartbeat
from backfill.serving.config import COMMAND_DEFAULTS, ServingConfig

# SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, intermediate 1536.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_s(fn, products: int = 30, timings: int = 7) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(timings):
        started = time.perf_counter()
        for _ in range(products):
            fn()
        best = min(best, (time.perf_counter() - started) / products)
    return best


def _time_shape(table: dict, name: str, out_features: int, in_features: int, rows_list: list[int],
                dtype: torch.dtype, has_kernel: bool) -> None:
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = pack_for_small_batches(weight) if has_kernel else None
    table[name] = {}
    for rows in rows_list:
        x = torch.randn(rows, in_features).to(dtype)
        flop = 2 * rows * in_features * out_features
        entry = {"linear_gflop_s": flop / best_s(lambda: torch.nn.functional.linear(x, weight)) / 1e9}
        if packed is not None:
            entry["small_batch_gflop_s"] = flop / best_s(lambda: packed_matmul(packed, x, out_features)) / 1e9
        table[name][rows] = entry
    print(name, "; ".join(f"{rows} rows: " + " / ".join(f"{v:.0f}" for v in e.values())
                          for rows, e in table[name].items()), "GFLOP/s (F.linear / small-batch)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 512])
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    dtype = ServingConfig(**COMMAND_DEFAULTS).torch_dtype
    has_kernel = load_small_batch_matmul()
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {dtype}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"timing {len(SHAPES)} shapes at {len(args.rows)} row counts: about {6 * len(args.rows)} s", flush=True)
    table: dict[str, dict[int, dict[str, float]]] = {}
    with Heartbeat(lambda line: print(line, flush=True), "timing",
                   lambda: f"{sum(len(rows) for rows in table.values())} of {len(SHAPES) * len(args.rows)} done"):
        for name, (out_features, in_features) in SHAPES.items():
            _time_shape(table, name, out_features, in_features, args.rows, dtype, has_kernel)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": str(dtype), "threads": torch.get_num_threads(),
                       "capability": torch.backends.cpu.get_cpu_capability(), "gflop_s": table}, f, indent=1)


if __name__ == "__main__":
    main()
