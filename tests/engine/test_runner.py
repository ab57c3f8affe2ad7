"""ModelRunner on a GPU: safepoints paced to the GPU's progress (runner.paced_on_gpu)."""

import pytest
import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.engine.weights import random_model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pacing is about asynchronous CUDA kernels")
def test_safepoints_wait_for_the_gpu_to_catch_up():
    cfg = ModelConfig.smollm2_135m()  # the default model's shape: a big prefill keeps the GPU busy
    runner = ModelRunner(LlamaModel(cfg, random_model(cfg), device="cuda"), KVBlockPool(cfg, 1024, 16, device="cuda"))
    g = torch.Generator().manual_seed(0)
    chunks = []
    for i in range(4):
        table = runner.kv.allocate(128)
        chunks.append(SeqChunk(i, torch.randint(3, cfg.vocab_size, (2048,), generator=g).tolist(), 0, table))
    events: list[torch.cuda.Event] = []
    behind: list[int] = []

    def safepoint(layer: int) -> bool:
        # Everything queued before the check before last must be done by the time this one runs.
        if len(events) >= 2 and not events[-2].query():
            behind.append(layer)
        event = torch.cuda.Event()
        event.record()
        events.append(event)
        return False

    for _ in range(2):
        out = runner.execute(chunks, safepoint)
    assert out.logits is not None and len(events) > 2 * cfg.num_layers
    assert behind == []

    def stop_at_five(layer: int) -> bool:
        return layer == 5

    aborted = runner.execute(chunks, stop_at_five)
    assert aborted.aborted and aborted.aborted_at_layer == 5
    assert torch.cuda.current_stream().query()  # the step has yielded the GPU when execute returns
