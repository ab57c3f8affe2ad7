"""Tiny random models and chat files for the finetune tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.engine.config import ModelConfig
from backfill.engine.model import LlamaModel
from tests.conftest import random_weights


def tiny_model(packed: bool = True, **overrides) -> LlamaModel:
    import os
    cfg = ModelConfig.tiny(**overrides)
    old = os.environ.get("BACKFILL_CPU_MATMUL")
    os.environ["BACKFILL_CPU_MATMUL"] = "onednn" if packed else "blas"
    try:
        return LlamaModel(cfg, random_weights(cfg, seed=1))
    finally:
        if old is None:
            os.environ.pop("BACKFILL_CPU_MATMUL")
        else:
            os.environ["BACKFILL_CPU_MATMUL"] = old


def write_chat_file(path: Path, n: int = 8, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda"]
    lines = []
    for i in range(n):
        a, b = (words[int(j)] for j in torch.randint(len(words), (2,), generator=g))
        lines.append(json.dumps({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Say {a} {i}"},
            {"role": "assistant", "content": f"{a} {b} {i}"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


TOKENIZER = ByteTokenizer()
