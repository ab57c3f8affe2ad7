"""Sampling on the device: the step's logits never leave the GPU, only one token id per row does.

The host sampler (`sample_picks`, engine/runner.py) copies the step's fp32 logits to the host and
samples there: at batch 64 and a 128k vocabulary that is 32 MiB over PCIe every step, then a loop
in Python. Here greedy, temperature, top-k and top-p run as a fixed sequence of tensor ops on the rows in
place and the host reads back [B] token ids. The ops never read the device from the host and have
no data-dependent shapes, so `sample_tokens` can be captured in a CUDA graph with the per-row
parameters as static tensors.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) draws one token with probability
p) instead of torch.multinomial, which synchronizes. The noise is a counter-based hash of a per-row
seed and the token index: a row's draw depends on its seed only, so a seeded request samples the
same tokens whatever it is batched with, as with the host sampler's per-request generators (each
step takes the row's seed from its request's generator). The tokens differ from the host sampler's
(another random stream) but follow the same distribution; greedy rows give the same tokens.

Rows that want penalties, logprobs or min-p keep the host sampler (`fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backfill.sampling_params import SamplingParams

# Below this a temperature means greedy, as in the host sampler.
MIN_TEMPERATURE = 1e-5
_MASK32 = 0xFFFFFFFF


def fits(params: list[SamplingParams]) -> bool:
    """Whether every row can be sampled on the device (no penalties, logprobs or min-p)."""
    return all(not p.penalized and p.logprobs is None and p.min_p == 0.0 for p in params)


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors [B] (static buffers when captured)."""

    temperature: torch.Tensor  # float32; < MIN_TEMPERATURE: greedy
    top_k: torch.Tensor        # int64; 0: off
    top_p: torch.Tensor        # float32; 1: off
    seed: torch.Tensor         # int64 in [0, 2^32)

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], device: torch.device) -> "RowParams":
        values = [[p.temperature, p.top_p] for p in params]
        floats = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
        ints = torch.tensor([[p.top_k, s & _MASK32] for p, s in zip(params, seeds)], dtype=torch.long)
        ints = ints.to(device, non_blocking=True)
        return cls(floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1])


def _mul32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """x * factor mod 2^32 for int64 tensors below 2^32, in 16-bit halves so no product overflows int64."""
    return ((x & 0xFFFF) * factor + ((((x >> 16) * factor) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values below 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds -> [B, vocab] uniforms in (0, 1), a pure function of (seed, token index)."""
    index = torch.arange(vocab, device=seed.device, dtype=torch.long)
    bits = _hash32((_hash32(seed & _MASK32).unsqueeze(1) ^ index.unsqueeze(0)) & _MASK32)
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32


def sample_tokens(logits: torch.Tensor, rows: RowParams, filtered: bool = True) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B] (int64, on the logits' device).

    filtered=False skips top-k/top-p (a sort of the vocabulary per row) where no row asks for them."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = rows.temperature < MIN_TEMPERATURE
    scores = logits / torch.where(greedy, 1.0, rows.temperature).unsqueeze(1)
    if filtered:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.where(rows.top_k > 0, rows.top_k, vocab).unsqueeze(1)
        probs = torch.softmax(sorted_scores, dim=-1)
        # top-p: the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = ((probs.cumsum(dim=-1) - probs) >= rows.top_p.unsqueeze(1)) | (rank >= k)
        drop[:, 0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    race = probs / -torch.log(uniform_noise(rows.seed, vocab))  # p / E, E ~ Exp(1)
    sampled = race.argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


class DeviceSampler:
    """Samples a step's rows on the logits' device; the scheduler reads back [B] token ids."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.rows_sampled = 0  # tests and benchmarks read it

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """One token per row; each non-greedy row draws its seed from its request's generator."""
        seeds = [0 if gen is None else int(torch.randint(0, 1 << 32, (1,), generator=gen))
                 for gen in generators]
        rows = RowParams.of(params, seeds, logits.device)
        if all(p.temperature < MIN_TEMPERATURE for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample_tokens(logits, rows, filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params))
        self.rows_sampled += len(params)
        return tokens.tolist()
