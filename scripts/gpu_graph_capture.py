"""How long capturing every decode-graph bucket at load takes, and whether a first step still pays.

Builds the serving stack's runner (random weights, SmolLM2-135M shape, bf16, 2 GiB of KV) on CUDA,
which captures every (batch, block-table) bucket up to max_model_len, then times 20 decode steps
at batch 1, 5 and 33: a step that had to capture its bucket would stand out as the first.

    python scripts/gpu_graph_capture.py
"""

from __future__ import annotations

import statistics
import time

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.step import SeqChunk
from backfill.engine.weights import random_model
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner

PROMPT_TOKENS = 197
STEPS = 20


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cfg = ModelConfig.smollm2_135m()
    started = time.perf_counter()
    runner = build_runner(cfg, random_model(cfg), ServingConfig(dtype="bfloat16", device="cuda", kv_cache_gb=2.0))
    torch.cuda.synchronize()
    print(f"build_runner with capture_all: {time.perf_counter() - started:.2f} s, "
          f"{len(runner.decode_graphs.captured_buckets)} buckets, "
          f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated")
    kv = runner.kv
    for batch in (1, 5, 33):
        tables = [kv.allocate(kv.blocks_needed(PROMPT_TOKENS + STEPS)) for _ in range(batch)]
        for i, table in enumerate(tables):
            runner.execute([SeqChunk(i, list(range(3, 3 + PROMPT_TOKENS)), 0, table, want_logits=False)])
        torch.cuda.synchronize()
        step_ms = []
        for step in range(STEPS):
            t0 = time.perf_counter()
            runner.execute([SeqChunk(i, [5], PROMPT_TOKENS + step, table) for i, table in enumerate(tables)])
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"batch {batch}: first decode step {step_ms[0]:.2f} ms, median {statistics.median(step_ms):.2f} ms, "
              f"buckets {len(runner.decode_graphs.captured_buckets)}")
        for table in tables:
            kv.free(table)


if __name__ == "__main__":
    main()
