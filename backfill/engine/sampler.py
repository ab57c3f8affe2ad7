"""Turns logits into tokens, each row with its own SamplingParams and random generator."""

from __future__ import annotations

import torch

from backfill.engine.sampling_params import SamplingParams


# Below this, logits / temperature overflows float32; such a temperature means greedy (as in vLLM).
_MIN_TEMPERATURE = 1e-5


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator: a seeded request samples the same tokens whatever it is batched with."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, vocab] fp32 -> one token per row."""
    logits = logits.float().cpu()
    greedy_tokens = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature < _MIN_TEMPERATURE:
            out.append(greedy_tokens[row])
            continue
        out.append(_sample_row(logits[row], p, gen))
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scores = logits / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        # Explicitly: a top_p below float32's range (1e-300) rounds to 0, and 0 >= 0 would drop it.
        drop[0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
