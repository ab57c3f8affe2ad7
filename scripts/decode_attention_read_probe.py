"""Decode attention against a bare read of the same KV blocks in the same order (docs/peers.md).

    python scripts/decode_attention_read_probe.py [--batches 8 32 64] [--context 170]

Thirty layers' pools of 1,500 random blocks each (16 tokens, 3 KV heads of 64, bf16, as the default
model's), a batch of sequences whose block tables are random blocks of them; per step, every layer:
(a) the paged decode-attention kernel, (b) a C++ pass that only reads every key and value row the
kernel reads, per (sequence, KV head), block by block, widened to fp32 and summed. Turns of the
two, medians of 12, on every core and on one; GB/s is the KV bytes of a step over its time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

READ_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
using Vec = at::vec::Vectorized<float>;
// Every key and value row a decode of these sequences reads, per (sequence, KV head), widened and summed.
torch::Tensor read_blocks(const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& tables,
                          const torch::Tensor& lens) {
  const int64_t batch = tables.size(0), width = tables.size(1), bs = k_pool.size(1), n_kv = k_pool.size(2),
                hd = k_pool.size(3);
  auto out = torch::zeros({batch * n_kv});
  const auto* k = k_pool.data_ptr<c10::BFloat16>();
  const auto* v = v_pool.data_ptr<c10::BFloat16>();
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, batch * n_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / n_kv, head = pair % n_kv;
      Vec total(0.0f);
      for (int64_t pos = 0; pos < l[seq]; ++pos) {
        const int64_t row = ((t[seq * width + pos / bs] * bs + pos % bs) * n_kv + head) * hd;
        for (int64_t d = 0; d < hd; d += Vec::size()) {
          Vec a, b;
          at::vec::load_fp32_from_bf16(k + row + d, a);
          at::vec::load_fp32_from_bf16(v + row + d, b);
          total = total + a + b;
        }
      }
      o[pair] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
    }
  });
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_blocks", &read_blocks); }
"""


def main() -> None:
    from backfill.engine.native_build import build_cpu_extension
    from backfill.engine.paged_attention import load_paged_decode_attention

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--context", type=int, default=170)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "read_blocks.cpp"
        source.write_text(READ_SOURCE)
        read = build_cpu_extension("backfill_read_blocks_probe", source).read_blocks
    kernel = load_paged_decode_attention()
    layers, blocks, block_size, n_kv, hd, n_q = 30, 1500, 16, 3, 64, 9
    k_pools = torch.randn(layers, blocks, block_size, n_kv, hd, dtype=torch.bfloat16)
    v_pools = torch.randn(layers, blocks, block_size, n_kv, hd, dtype=torch.bfloat16)
    arms = {"kernel": lambda q, k, v, t, n: kernel(q, k, v, t, n), "read": lambda q, k, v, t, n: read(k, v, t, n)}
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        for batch in args.batches:
            width = -(-args.context // block_size)
            tables = torch.randperm(blocks)[:batch * width].view(batch, width).contiguous()
            lens = torch.full((batch,), args.context, dtype=torch.long)
            q = torch.randn(batch, n_q, hd, dtype=torch.bfloat16)
            times = {arm: [] for arm in arms}
            for turn in range(13):
                for arm in (arms if turn % 2 else reversed(list(arms))):
                    start = time.perf_counter()
                    for layer in range(layers):
                        arms[arm](q, k_pools[layer], v_pools[layer], tables, lens)
                    if turn:
                        times[arm].append(time.perf_counter() - start)
            gb = batch * args.context * n_kv * hd * 2 * 2 * layers / 1e9
            print(f"{threads} thread(s), {batch} sequences: " + ", ".join(
                f"{arm} {statistics.median(t) * 1e3:.1f} ms ({gb / statistics.median(t):.1f} GB/s)"
                for arm, t in times.items()))


if __name__ == "__main__":
    main()
