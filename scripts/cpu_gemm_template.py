"""Small-batch bf16 matmuls on CPU: eager F.linear against inductor's CPP GEMM template (max-autotune).

Thirty [N x K] weights, as many as the model has layers, so the weights stream from memory as in
a decode step rather than sitting in cache. Each batch size M is compiled on its own (dynamic=False).

    .venv/bin/python scripts/cpu_gemm_template.py [--n 3072] [--k 576] [--batches 1 4 8 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

LAYERS = 30


class Projections(torch.nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(n, k, dtype=torch.bfloat16) * 0.02, requires_grad=False)
             for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for w in self.weights:
            out = F.linear(x, w)[:, :x.shape[1]] + out  # chained, so no projection is dropped
        return out


def _median_ms(fn, x: torch.Tensor, reps: int = 50) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args()
    inductor_config.freezing = True
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP"
    torch.manual_seed(0)
    model = Projections(args.n, args.k).eval()
    gb = LAYERS * args.n * args.k * 2 / 1e9
    for m in args.batches:
        x = torch.randn(m, args.k, dtype=torch.bfloat16)
        with torch.no_grad():
            compiled = torch.compile(model, dynamic=False)
            compiled(x)
            eager_ms, template_ms = _median_ms(model, x), _median_ms(compiled, x)
        print(f"M={m:3d}, {LAYERS} x [{args.n} x {args.k}] ({gb * 1e3:.0f} MB): eager {eager_ms:.2f} ms "
              f"({gb / eager_ms * 1e3:.0f} GB/s), CPP template {template_ms:.2f} ms ({gb / template_ms * 1e3:.0f} GB/s)")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
