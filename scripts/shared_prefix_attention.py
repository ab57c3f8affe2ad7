"""Attention over a shared prefix, the CPU kernels' paths side by side (docs/prefix-caching.md).

Decode: a batch of sequences whose block tables start with the same blocks (one cached system
prompt), each with a few blocks of its own, through the paged decode kernel walking every table
alone (min_shared_blocks=0), reading the shared blocks once on vectors (tiles=False), and on AMX
tiles where the CPU has them. Prompt: chunks of new tokens after that prefix (a Batch file's
questions), through the prompt kernel with and without tiles. The paths run in turns, rounds after
rounds; each figure is the median of a path's calls over all rounds, per layer (one call).
--dtype float32 runs the fp32 KV cache of a CPU without bf16 kernels (vectors only).

    python scripts/shared_prefix_attention.py --json shared-prefix.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from backfill.engine.paged_attention import (load_paged_decode_attention, load_paged_prompt_attention,
                                             shared_prefix_tiles_available)


def prefixed_tables(args, g, count: int, own_tokens: int):
    """Pools, and count block tables that start with one prefix of args.prefix_tokens and then each
    hold own_tokens of their own."""
    shape = (args.pool_blocks, 16, args.kv_heads, args.head_dim)
    k_pool, v_pool = (torch.randn(shape, generator=g).to(args.torch_dtype) for _ in range(2))
    free = torch.randperm(args.pool_blocks, generator=g).tolist()
    prefix = [free.pop() for _ in range(args.prefix_tokens // 16)]
    tables = [prefix + [free.pop() for _ in range(-(-own_tokens // 16))] for _ in range(count)]
    return k_pool, v_pool, torch.tensor(tables)


def decode_case(args, g):
    k_pool, v_pool, tables = prefixed_tables(args, g, args.sequences, args.own_tokens)
    lens = torch.full((args.sequences,), args.prefix_tokens + args.own_tokens)
    q = torch.randn(args.sequences, args.heads, args.head_dim, generator=g).to(args.torch_dtype)
    return q, k_pool, v_pool, tables, lens


def prompt_case(args, g):
    k_pool, v_pool, tables = prefixed_tables(args, g, args.chunks, args.chunk_tokens)
    spans = torch.tensor([(i * args.chunk_tokens, args.chunk_tokens, args.prefix_tokens) for i in range(args.chunks)])
    q = torch.randn(args.chunks * args.chunk_tokens, args.heads, args.head_dim, generator=g).to(args.torch_dtype)
    return q, k_pool, v_pool, spans, tables


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=9, help="query heads (the default model's)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1024, help="the shared prefix, whole 16-token blocks")
    p.add_argument("--sequences", type=int, default=64, help="decoding sequences")
    p.add_argument("--own-tokens", type=int, default=40, help="each sequence's context after the prefix")
    p.add_argument("--chunks", type=int, default=64, help="prompt chunks after the prefix")
    p.add_argument("--chunk-tokens", type=int, default=30)
    p.add_argument("--pool-blocks", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="calls per path per round")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the KV cache's dtype (float32: a CPU without bf16 kernels, where tiles do not apply)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    args.torch_dtype = getattr(torch, args.dtype)
    decode, prompt = load_paged_decode_attention(), load_paged_prompt_attention()
    if decode is None or prompt is None:
        raise SystemExit("the C++ kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    d_args, p_args = decode_case(args, g), prompt_case(args, g)
    out = torch.empty_like(p_args[0])
    paths = {
        "decode, each table alone": lambda: decode(*d_args, min_shared_blocks=0),
        "decode, prefix once, vectors": lambda: decode(*d_args, tiles=False),
        "decode, prefix once, tiles": lambda: decode(*d_args, tiles=True),
        "prompt, vectors": lambda: prompt(*p_args, out, tiles=False),
        "prompt, prefix on tiles": lambda: prompt(*p_args, out, tiles=True),
    }
    if args.dtype != "bfloat16":  # tiles take bf16 only: those paths would run the vectors again
        paths = {name: call for name, call in paths.items() if "tiles" not in name}
    times: dict[str, list[float]] = {name: [] for name in paths}
    # A round is about 1.5 s on a 2-core Xeon with AMX (the vector prompt path is most of it), a few
    # times that without tiles: each round says when it is done.
    print(f"{args.rounds} rounds of {args.calls} calls per path, {len(paths)} paths", flush=True)
    for round_index in range(args.rounds):
        for name, call in paths.items():
            call()  # warm
            for _ in range(args.calls):
                t0 = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - t0) * 1e3)
        print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    tiles = shared_prefix_tiles_available()
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, AMX tiles: {tiles}")
    print(f"decode: {args.sequences} sequences, {args.prefix_tokens} shared + {args.own_tokens} own tokens; "
          f"prompt: {args.chunks} chunks of {args.chunk_tokens} after {args.prefix_tokens} shared")
    for name, ms in medians.items():
        print(f"  {name:32s} {ms:8.3f} ms per layer (median of {len(times[name])} calls)")
    if args.json:
        with open(args.json, "w") as f:
            config = {k: v for k, v in vars(args).items() if k != "torch_dtype"}
            json.dump({"config": config, "threads": torch.get_num_threads(), "tiles_available": tiles,
                       "median_ms_per_layer": medians, "calls_per_path": len(next(iter(times.values())))},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
