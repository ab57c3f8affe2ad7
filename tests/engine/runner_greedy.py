"""Greedy decoding straight on a ModelRunner, shared by the tests that compare two runners."""

from __future__ import annotations

import torch

from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk


def greedy_decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt, then decode all of them together; every sequence's tokens and each step's logits."""
    kv, tables, tokens, logits = runner.kv, [], [], []
    for i, ids in enumerate(prompts):
        tables.append(kv.allocate(kv.blocks_needed(len(ids) + steps)))
        out = runner.execute([SeqChunk(i, ids, 0, tables[i])])
        tokens.append([int(out.logits[0].argmax())])
    for _ in range(steps):
        out = runner.execute([SeqChunk(i, [tokens[i][-1]], len(ids) + len(tokens[i]) - 1, tables[i])
                              for i, ids in enumerate(prompts)])
        assert out.logit_seq_ids == list(range(len(prompts)))
        logits.append(out.logits)
        for i, row in enumerate(out.logits):
            tokens[i].append(int(row.argmax()))
    for table in tables:
        kv.free(table)
    return tokens, logits
