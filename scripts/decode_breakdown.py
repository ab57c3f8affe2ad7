"""Where a compiled batch-1 decode step's time goes, piece by piece, against the read bandwidth.

Wraps each compiled piece (backfill/engine/compiled_decode.py), the KV write and the paged
attention kernel with a timer, runs blocks of decode steps (random weights, SmolLM2-135M shape)
and after each block reads a 256 MiB buffer: each weight piece's bytes over its time, next to the
bandwidth the machine gave a plain streaming read in the same minute.

    .venv/bin/python scripts/decode_breakdown.py [--dtype float32] [--blocks 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import fields

from backfill.bench.engine_bench import BandwidthProbe
from backfill.engine.config import ModelConfig
from backfill.engine.step import SeqChunk
from backfill.engine.weights import random_model
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner

PROMPT_TOKENS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    cfg = ModelConfig.smollm2_135m()
    runner = build_runner(cfg, random_model(cfg), ServingConfig(dtype=args.dtype, device="cpu", kv_cache_gb=0.5,
                                                                compile_decode=True))
    model = runner.model
    if model.compiled_decode is None or not model.compiled_decode.ready:
        raise SystemExit("compiled decode is unavailable here")
    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def run(*a):
            start = time.perf_counter()
            out = fn(*a)
            spent[name] += time.perf_counter() - start
            return out
        return run

    pieces = model.compiled_decode.pieces[1]
    for f in fields(pieces):
        setattr(pieces, f.name, timed(f.name, getattr(pieces, f.name)))
    model._write_kv = timed("kv write", model._write_kv)
    if model.paged_decode_attention is not None:
        model.paged_decode_attention = timed("attention", model.paged_decode_attention)
    # Bytes each piece reads per step: its weights in all layers.
    plain, size = model.compiled_decode.layers, model.compiled_decode.lm_head.element_size()
    weight_bytes = {"qkv_rope": sum(w.qkv.numel() for w in plain) * size,
                    "o_then_norm": sum(w.o.numel() for w in plain) * size,
                    "gate_up_silu": sum(w.gate_up.numel() for w in plain) * size,
                    "down_then_norm": sum(w.down.numel() for w in plain) * size,
                    "lm_head_logits": model.compiled_decode.lm_head.numel() * size}
    kv = runner.kv
    table = kv.allocate(kv.blocks_needed(PROMPT_TOKENS + args.blocks * args.steps))
    runner.execute([SeqChunk(0, list(range(3, 3 + PROMPT_TOKENS)), 0, table, want_logits=False)])
    probe = BandwidthProbe("cpu")
    position = PROMPT_TOKENS
    for _ in range(args.blocks):
        spent.clear()
        step_ms = []
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.execute([SeqChunk(0, [5], position, table)])
            step_ms.append((time.perf_counter() - start) * 1e3)
            position += 1
        read_gbs = probe.read_gbs()
        floor_ms = sum(weight_bytes.values()) / read_gbs / 1e6
        median = statistics.median(step_ms)
        print(f"[{args.dtype}] step median {median:.2f} ms; streaming read {read_gbs:.1f} GB/s, "
              f"floor {floor_ms:.2f} ms ({median / floor_ms:.2f}x)")
        for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            per_step_ms = seconds / args.steps * 1e3
            rate = f"  {weight_bytes[name] / per_step_ms / 1e6:5.1f} GB/s" if name in weight_bytes else ""
            print(f"   {name:15s} {per_step_ms:5.2f} ms{rate}")
        print(f"   {'the rest':15s} {sum(step_ms) / args.steps - sum(spent.values()) / args.steps * 1e3:5.2f} ms")


if __name__ == "__main__":
    main()
