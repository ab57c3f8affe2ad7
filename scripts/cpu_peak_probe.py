"""The machine's multiply-add peak per core, and the bf16 matmul rate against it (docs/peers.md).

    python scripts/cpu_peak_probe.py [--json FILE]

1. Instruction throughput on one core, then on every core at once (one process each): VDPBF16PS
   (512-bit, bf16 pairs into fp32), VFMADD on 512-bit and on 256-bit registers, each with twelve
   independent accumulators, so the figure is the instruction's issue rate, not its latency.
2. bf16 matmuls of the default model's shapes (SmolLM2-135M: q/k/v 960x576, o 576x576, gate/up
   3072x576, down 576x1536, LM head 49152x576) at 64 and 512 rows on every core: oneDNN with the
   weight packed (the eager path) and backfill's small-batch kernel (the compiled pieces), medians
   of ten, as GFLOP/s and as a share of (1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <cstdio>
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
template <typename V, typename Op> double rate(V seed, Op op, double flop_per_instruction) {
  V acc[12];
  for (int a = 0; a < 12; ++a) { acc[a] = seed; __asm__ volatile("" : "+v"(acc[a])); }  // not provably equal
  V w = seed;
  const long n = 50000000; const double start = now();
  for (long i = 0; i < n; ++i) {
    __asm__ volatile("" : "+v"(w));  // a new operand each iteration: nothing can be folded
    #pragma GCC unroll 12
    for (int a = 0; a < 12; ++a) acc[a] = op(acc[a], w);
  }
  const double seconds = now() - start;
  for (int a = 1; a < 12; ++a) __asm__ volatile("" :: "v"(acc[a]));
  __asm__ volatile("" :: "v"(acc[0]));
  return n * 12.0 * flop_per_instruction / seconds / 1e9;
}
int main() {
  const double bf16 = rate(_mm512_set1_ps(1e-3f), [](__m512 a, __m512 w) {
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(w)); }, 64);
  const double fma512 = rate(_mm512_set1_ps(1e-3f), [](__m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, w); }, 32);
  const double fma256 = rate(_mm256_set1_ps(1e-3f), [](__m256 a, __m256 w) { return _mm256_fmadd_ps(a, w, w); }, 16);
  std::printf("%.1f %.1f %.1f\n", bf16, fma512, fma256);
}
"""

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def instruction_peaks(binary: Path) -> dict:
    """GFLOP/s per core of each instruction: one core alone, then every core at once (summed)."""
    alone = [float(x) for x in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()]
    cores = os.cpu_count() or 1
    procs = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
    together = [[float(x) for x in p.communicate()[0].split()] for p in procs]
    names = ("vdpbf16ps_512", "vfmadd_512", "vfmadd_256")
    return {name: {"one_core_gflops": alone[i], "all_cores_gflops": sum(t[i] for t in together)}
            for i, name in enumerate(names)} | {"cores": cores}


def median_s(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rates(peak_gflops: float) -> list[dict]:
    from backfill.engine.linear import Linear
    from backfill.engine.small_batch_matmul import load_small_batch_matmul, pack_for_small_batches

    kernel = load_small_batch_matmul()
    rows_out = []
    for rows in (64, 512):
        for name, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            flop = 2 * rows * n * k
            onednn = Linear(weight, True, torch.bfloat16)
            row = {"rows": rows, "weight": name, "onednn_gflops": flop / median_s(lambda: onednn(x)) / 1e9}
            if kernel:
                packed = pack_for_small_batches(weight)
                row["small_batch_gflops"] = flop / median_s(lambda: torch.ops.backfill.packed_matmul(packed, x, n)) / 1e9
            for key in [k for k in row if k.endswith("_gflops")]:
                row[key.replace("_gflops", "_share_of_peak")] = row[key] / peak_gflops
            rows_out.append(row)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        source.write_text(PEAK_SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", str(source), "-o", str(binary)], check=True)
        peaks = instruction_peaks(binary)
    for name in ("vdpbf16ps_512", "vfmadd_512", "vfmadd_256"):
        p = peaks[name]
        print(f"{name:14s} one core {p['one_core_gflops']:6.1f} GFLOP/s, {peaks['cores']} cores at once "
              f"{p['all_cores_gflops']:6.1f}")
    peak = peaks["vdpbf16ps_512"]["all_cores_gflops"]
    matmuls = matmul_rates(peak)
    for row in matmuls:
        extra = (f", small-batch kernel {row['small_batch_gflops']:5.0f} ({row['small_batch_share_of_peak']:.0%})"
                 if "small_batch_gflops" in row else "")
        print(f"{row['rows']:4d} rows x {row['weight']:8s}: oneDNN {row['onednn_gflops']:5.0f} GFLOP/s "
              f"({row['onednn_share_of_peak']:.0%} of the VDPBF16PS peak){extra}")
    if args.json:
        args.json.write_text(json.dumps({"instruction_peaks": peaks, "matmuls": matmuls,
                                         "torch_threads": torch.get_num_threads(), "argv": sys.argv}, indent=2))


if __name__ == "__main__":
    main()
