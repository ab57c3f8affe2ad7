"""Step times of prefills whose shapes the process has not seen, with and without cuDNN's SDPA.

On an H100 with PyTorch 2.11, SDPA may send attention to cuDNN, which builds an execution plan for
every new shape; co-serving prefill spans come in many lengths. Random weights, SmolLM2-135M shape.

    python scripts/gpu_prefill_shapes.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.engine.weights import random_model


def step_ms(runner: ModelRunner, lengths: list[int]) -> float:
    chunks = []
    for i, n in enumerate(lengths):
        chunks.append(SeqChunk(i, [5] * n, 0, runner.kv.allocate(runner.kv.blocks_needed(n))))
    start = time.perf_counter()
    runner.execute(chunks)
    elapsed = (time.perf_counter() - start) * 1e3
    for chunk in chunks:
        runner.kv.free(chunk.block_table)
    return elapsed


def main() -> None:
    cfg = ModelConfig.smollm2_135m()
    model = LlamaModel(cfg, random_model(cfg), dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, KVBlockPool(cfg, 4096, 16, torch.bfloat16, "cuda"))
    step_ms(runner, [64, 64])  # cuBLAS and allocator warm-up
    lengths = random.Random(0).sample(range(100, 1000), 60)
    for name, cudnn in (("cuDNN SDPA allowed", True), ("cuDNN SDPA off", False)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        new = [step_ms(runner, [n, n + 1]) for n in lengths[:30]]
        seen = [step_ms(runner, [n, n + 1]) for n in lengths[:30]]
        lengths = lengths[30:]
        print(f"{name}: new shapes median {statistics.median(new):.1f} ms, max {max(new):.1f}; "
              f"the same shapes again median {statistics.median(seen):.1f} ms, max {max(seen):.1f}")


if __name__ == "__main__":
    main()
