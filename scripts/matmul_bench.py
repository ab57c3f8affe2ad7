"""Time the default model's weight matmuls alone, in three layouts, at decode batch sizes.

Shows how far each CPU kernel is from the memory bandwidth for the shapes a decode step runs:
x @ W with W stored [in, out] and F.linear with W stored [out, in] (both go to the BLAS, MKL in
PyTorch's x86 wheels), and oneDNN with the weight packed once into its blocked layout (what the
engine uses, backfill/engine/linear.py). The layer weights are small enough to sit in cache
between repeats, so their GB/s are upper bounds; the LM head streams from memory.

    .venv/bin/python scripts/matmul_bench.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from backfill.engine.linear import Linear, onednn_packing_enabled

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, LM head (hidden 576, MLP 1536, vocab 49152).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def _median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("dtype     matmul   batch   x@W[in,out] us (GB/s)   F.linear[out,in] us (GB/s)   oneDNN packed us (GB/s)")
    for dtype in (torch.float32, torch.bfloat16):
        packed = onednn_packing_enabled(torch.device("cpu"), dtype)
        for name, (n_in, n_out) in SHAPES.items():
            w_in_out = torch.randn(n_in, n_out, dtype=dtype)
            w_out_in = w_in_out.t().contiguous()
            gigabytes = w_in_out.numel() * w_in_out.element_size() / 1e9
            for batch in (1, 8, 32):
                x = torch.randn(batch, n_in, dtype=dtype)
                a = _median_us(lambda: x @ w_in_out, args.repeats)
                b = _median_us(lambda: F.linear(x, w_out_in), args.repeats)
                row = (f"{str(dtype).removeprefix('torch.'):9s} {name:8s} {batch:5d}   "
                       f"{a:10.1f} ({gigabytes / a * 1e6:5.1f})        {b:10.1f} ({gigabytes / b * 1e6:5.1f})")
                if packed:
                    lin = Linear(w_out_in, packed=True)
                    c = _median_us(lambda: lin(x), args.repeats)
                    row += f"            {c:10.1f} ({gigabytes / c * 1e6:5.1f})"
                print(row)


if __name__ == "__main__":
    main()
