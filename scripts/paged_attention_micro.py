"""The paged decode attention kernel alone, on one layer of a random pool: time per call and the
bandwidth it reaches (the keys and values it must read, over its time).

Blocks are handed out in a random order, as a pool that has served a while hands them out.

    .venv/bin/python scripts/paged_attention_micro.py [--cases 1x1024 16x600 32x200] [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from backfill.engine.paged_attention import load_paged_decode_attention

# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64, 30 layers, blocks of 16 tokens.
N_Q, N_KV, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30


def time_case(kernel, dtype: torch.dtype, batch: int, context: int, calls: int) -> dict:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_pool = torch.randn(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM).to(dtype)
    v_pool = torch.randn(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM).to(dtype)
    tables = torch.randperm(num_blocks)[:batch * blocks_per_seq].view(batch, blocks_per_seq).contiguous()
    q = torch.randn(batch, N_Q, HEAD_DIM).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.long)
    for _ in range(10):
        kernel(q, k_pool, v_pool, tables, lens)
    times_s = []
    for _ in range(calls):
        start = time.perf_counter()
        kernel(q, k_pool, v_pool, tables, lens)
        times_s.append(time.perf_counter() - start)
    call_us = statistics.median(times_s) * 1e6
    kv_bytes = 2 * batch * context * N_KV * HEAD_DIM * k_pool.element_size()
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "call_us": call_us,
            "read_gbs": kv_bytes / call_us / 1e3,
            "ms_per_kctx_all_layers": call_us * LAYERS / 1e3 / (batch * context / 1e3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["1x1024", "16x600", "32x200"], help="BATCHxCONTEXT")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    kernel = load_paged_decode_attention()
    if kernel is None:
        raise SystemExit("the kernel could not be built here (see the warning above)")
    torch.manual_seed(0)
    for dtype_name in args.dtypes:
        for case in args.cases:
            batch, context = (int(x) for x in case.split("x"))
            r = time_case(kernel, getattr(torch, dtype_name), batch, context, args.calls)
            print(f"{r['dtype']:>8} batch {batch:>3} context {context:>5}: {r['call_us']:7.1f} us per layer, "
                  f"{r['read_gbs']:5.1f} GB/s, {r['ms_per_kctx_all_layers']:.2f} ms per 1,000 tokens of context "
                  f"over {LAYERS} layers")


if __name__ == "__main__":
    main()
